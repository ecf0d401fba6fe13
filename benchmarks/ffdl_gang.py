"""FfDL §5.3: deadlocked learners without gang scheduling, none with it.

15 nodes × 4 GPUs, 50 jobs each of 2×1, 2×2, 4×1 (learners × GPUs) submitted
together, 20 runs with different seeds, per-pod baseline vs gang + SPREAD vs gang +
PACK, all through the real scheduler. Paper: per-pod deadlocks in 60 % of runs, up to
46 % of GPUs idle; gang scheduling: 0.

    .venv/bin/python benchmarks/ffdl_gang.py [--runs 20] [--json]
"""

from __future__ import annotations

import sys

from services.scheduler.sim.cli import main

if __name__ == "__main__":
    sys.exit(main(["ffdl-gang", *sys.argv[1:]]))
