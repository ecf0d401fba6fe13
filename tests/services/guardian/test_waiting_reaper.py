"""The guardian process's reaper (services/guardian/__main__.py `WaitingReaper`): exits are
reported with their codes, orphans are reaped, a child its starter waits for keeps its
code, and the thread wakes for exits only (no poll). Run in a child interpreter of its own: a reaper reaps every child of its process,
and this one's children include the test servers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, os, subprocess, sys, threading, time
from contract import procs
from services.guardian.__main__ import WaitingReaper

procs.become_subreaper()  # as the guardian is: orphans of its learners land on it


class Counting(WaitingReaper):
    rounds = 0

    def reap_once(self):
        Counting.rounds += 1
        super().reap_once()


def until(what, done, limit_s=30.0):
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.01)


reaper = Counting().start()
codes = {}
sleep = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(int(sys.argv[2]))"

# a child that runs for a second, watched while it runs
slow = subprocess.Popen([sys.executable, "-c", sleep, "1.0", "7"])
reaper.watch(slow.pid, lambda pid, code: codes.__setitem__("slow", code))
until("the slow child's exit", lambda: "slow" in codes)
rounds_for_one_exit = Counting.rounds

# a child that exits before anyone asks: its code is kept for a later watch
quick = subprocess.Popen([sys.executable, "-c", sleep, "0", "3"])
until("the quick child reaped", lambda: reaper.exit_code(quick.pid) is not None)
reaper.watch(quick.pid, lambda pid, code: codes.__setitem__("quick", code))

# an orphan: its parent exits at once, it is re-parented to us and must not stay a zombie
shell = subprocess.run(
    ["/bin/sh", "-c", "sleep 0.3 & echo $!"], capture_output=True, text=True, check=True
)
orphan = int(shell.stdout.strip())


def gone(pid):
    return not os.path.exists(f"/proc/{pid}")  # a zombie keeps its entry until reaped


until("the orphan reaped", lambda: gone(orphan))

# a child its starter waits for itself (subprocess.run): left to it, so it reads the code
own_codes = [subprocess.run([sys.executable, "-c", sleep, "0", "5"]).returncode for _ in range(5)]
print(json.dumps(
    {"codes": codes, "rounds_for_one_exit": rounds_for_one_exit, "own_codes": own_codes}
))
"""


def test_the_guardian_reaper_reports_exits_reaps_orphans_and_wakes_only_for_exits() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["codes"] == {"slow": 7, "quick": 3}
    assert got["own_codes"] == [5] * 5
    # one child ran for a second: a poll every 50 ms would have reaped ~20 times; the
    # waiting reaper reaps when an exit wakes it (the first watch may add one round)
    assert got["rounds_for_one_exit"] <= 2, got
