"""FfDL §5.2 shape: jobs queued over 15 minutes under SPREAD vs PACK on 400 GPUs.

180 K80 + 220 V100 (4 per node), a synthetic day of Poisson arrivals at 90 % offered
load, strict FCFS per GPU type. Paper: PACK has more than 3× fewer such jobs.

    .venv/bin/python benchmarks/ffdl_pack.py [--seeds 3] [--load 0.9] [--json]
"""

from __future__ import annotations

import sys

from services.scheduler.sim.cli import main

if __name__ == "__main__":
    sys.exit(main(["ffdl-pack", *sys.argv[1:]]))
