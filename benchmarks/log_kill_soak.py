"""Log durability soak: the collector/TDS/search-server kill sequence, many times, with
and without the collector's store checks, in one run.

    .venv/bin/python benchmarks/log_kill_soak.py [--runs 10] [--json]

Each run is `kill_sequence` of tests/learner/controller/test_collector_kill.py: a learner
prints 3,000 stdout and 300 stderr lines while the collector is SIGKILLed and restarted,
the TDS is SIGKILLed and restarted, and the search server (noida-db) is stopped and
restarted while batches are still arriving. A run is *lossless* when the TDS returns
exactly the learner's own lines, in order, none missing, none twice.

Runs alternate between the two collector settings so that machine load hits both alike:
- checks off (`--verify-interval-s 0`): the collector trusts every acknowledgement, as it
  did before; noida-db drops acknowledged writes that race its shutdown, so some runs lose
  lines;
- checks on (the default, every 5 s and before exit): the collector counts what the store
  holds and resends what is missing.
Prints, for each setting, lossless runs out of runs, lines lost in all, and how many runs
needed a resend.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.learner.controller.test_collector_kill import kill_sequence  # noqa: E402


def _lost(run_expected: list[tuple[int, str]], stored: list[tuple[int, str]]) -> int:
    return len(set(run_expected) - set(stored))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs of each setting")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args()
    settings = {"checks-off": 0.0, "checks-on": 5.0}
    tally = {k: {"runs": 0, "lossless": 0, "lines_lost": 0, "resent_runs": 0} for k in settings}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rz-soak-") as tmp:
        for i in range(args.runs):
            for name, verify_s in settings.items():
                run = kill_sequence(Path(tmp) / f"{name}-{i}", verify_s=verify_s)
                t = tally[name]
                lost = sum(_lost(run.expected(s), run.stored[s]) for s in ("stdout", "stderr"))
                exact = all(run.stored[s] == run.expected(s) for s in ("stdout", "stderr"))
                t["runs"] += 1
                t["lossless"] += int(exact)
                t["lines_lost"] += lost
                t["resent_runs"] += int(run.resends > 0)
                if not args.json:
                    print(
                        f"run {i + 1:>3} {name:<10} lost {lost:>4} lines, "
                        f"{'exact' if exact else 'NOT exact'}, resends {run.resends}",
                        flush=True,
                    )
    if args.json:
        print(json.dumps({"settings": tally, "seconds": round(time.monotonic() - t0, 1)}))
        return 0
    print()
    print(f"{'setting':<12}{'lossless runs':>16}{'lines lost':>12}{'runs that resent':>18}")
    for name, t in tally.items():
        print(
            f"{name:<12}{t['lossless']:>9} of {t['runs']:<4}{t['lines_lost']:>12}"
            f"{t['resent_runs']:>18}"
        )
    print(
        f"goal: every checks-on run lossless -> {'met' if tally['checks-on']['lossless'] == tally['checks-on']['runs'] else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
