"""The controller's (and guardian's) 1 s grpc wait slices (`quiet_grpc_waits`, issue #16):
set by each process's main, and an etcd watch still delivers every change, and a lease
still lives on its keep-alives, with them. Run in a child interpreter: the slice is a
module global of grpc's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = r"""
import json, sys, threading, time
import grpc._common
from learner.controller.__main__ import GRPC_WAIT_SLICE_S, quiet_grpc_waits
from services.guardian.__main__ import quiet_grpc_waits as guardian_quiet
from contract.etcd import EtcdClient

before = grpc._common.MAXIMUM_WAIT_TIMEOUT
quiet_grpc_waits()
guardian_quiet()
etcd = EtcdClient.connect(sys.argv[1])
seen = []
changed = threading.Event()


def on_change():
    seen.append(etcd.get("/grpc-waits/key").value if etcd.get("/grpc-waits/key") else None)
    changed.set()


etcd.watch("/grpc-waits/key", on_change)
lease = etcd.grant(1).keep_alive()  # TTL 1 s: alive only while its keep-alives are answered
etcd.put("/grpc-waits/held", 1, lease=lease)
for n in range(5):
    changed.clear()
    etcd.put("/grpc-waits/key", n)
    if not changed.wait(30):
        sys.exit(f"change {n} was not delivered")
    time.sleep(0.5)
print(json.dumps({
    "before": before,
    "slice": grpc._common.MAXIMUM_WAIT_TIMEOUT,
    "wanted": GRPC_WAIT_SLICE_S,
    "last_seen": seen[-1],
    "held": etcd.get("/grpc-waits/held") is not None,
}))
"""


def test_the_wait_slice_is_raised_and_watches_and_keep_alives_still_work(
    etcd_server: Any,
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(etcd_server.url)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["before"] == 0.1 and got["slice"] == got["wanted"] == 1.0
    assert got["last_seen"] == 4
    # 2.5 s of a 1 s lease: its keep-alives (every 0.25 s) were answered throughout
    assert got["held"]
