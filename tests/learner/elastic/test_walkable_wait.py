"""A worker that walked away from a blocked all-reduce still exits with its own code.

gloo cannot cancel a wait, so the walked-away one stays blocked until its peer goes. When
that peer exits while the worker itself is exiting, the wait comes back from C++ during
interpreter finalization; on a daemon thread that aborted the process ("terminate called
without an active exception", exit -6: the CI failure of
tests/integration/test_elastic.py on 2026-11-27). Real processes and a real gloo group."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from contract.procs import free_port

REPO = Path(__file__).resolve().parents[3]

PAIR = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from learner.elastic.worker import walkable_wait

    rank, port, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=30))
    group = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
    buf = torch.ones(4)
    group.allreduce([buf]).wait()  # the group works
    if rank == 0:
        # an all-reduce rank 1 never joins: blocked until rank 1 goes
        done, _ = walkable_wait(lambda: group.allreduce([buf]).wait(), "walked-away")
        assert not done.wait(0.3), "the lone all-reduce completed"
        store.set("exiting", "1")
        sys.exit(7)  # walks away: the process exits with its own code
    else:
        store.wait(["exiting"])
        time.sleep(delay)  # goes while rank 0 finalizes
        os._exit(0)
    """
)


@pytest.mark.parametrize("delay", [0.02, 0.05, 0.1])
def test_a_walked_away_wait_ends_as_its_peer_exits_and_the_process_keeps_its_exit_code(
    tmp_path: Path, delay: float
) -> None:
    script = tmp_path / "pair.py"
    script.write_text(PAIR)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(script)]
    walker = subprocess.Popen(
        [*cmd, "0", str(port), str(delay)], env=env, stderr=subprocess.PIPE, text=True
    )
    peer = subprocess.Popen(
        [*cmd, "1", str(port), str(delay)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        _, peer_err = peer.communicate(timeout=60)
        _, walker_err = walker.communicate(timeout=60)
    finally:
        for p in (walker, peer):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert peer.returncode == 0, peer_err
    assert walker.returncode == 7, f"exit {walker.returncode}, not the script's 7:\n{walker_err}"
    assert "terminate called" not in walker_err, walker_err
