"""Where the platform's parts live. Flags win over environment variables, which win
over the defaults; `rhizome up --embedded` fills these in for the daemon it starts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

# Where root keeps the platform's data when its home is closed to other users.
SYSTEM_DATA_DIR = Path("/var/lib/rhizome")


def default_data_dir(
    env: str | None = None, home: Path | None = None, euid: int | None = None
) -> Path:
    """`$RHIZOME_DATA_DIR`, else `~/.rhizome`, except for root whose home others cannot
    enter (Debian's and most images' 0700 `/root`) and who has no `~/.rhizome` yet:
    `/var/lib/rhizome`, as root's daemons (dockerd, containerd) keep theirs. Why: a
    job's learners run under their own unprivileged uid only if that uid can reach the
    job's directory inside the data directory; under a closed `/root` they could not, and
    the local backend would run them as root (docs/security.md). An existing
    `~/.rhizome` is kept, so an upgrade never moves a user's data by itself."""
    env = os.environ.get("RHIZOME_DATA_DIR") if env is None else env
    if env:
        return Path(env).expanduser()
    home = Path.home() if home is None else home
    euid = os.geteuid() if euid is None else euid
    personal = home / ".rhizome"
    if euid != 0 or personal.exists():
        return personal
    try:
        closed = not home.stat().st_mode & 0o001
    except OSError:
        closed = True
    return SYSTEM_DATA_DIR if closed else personal


DEFAULT_DATA_DIR = default_data_dir()
DEFAULT_API_ADDRESS = "127.0.0.1:50051"
ALL_SERVICES = ("api", "scheduler", "lcm", "tds")


@dataclass
class PlatformConfig:
    data_dir: Path = DEFAULT_DATA_DIR
    mongodb_uri: str = ""
    etcd_url: str = ""
    elasticsearch_url: str = ""
    services: tuple[str, ...] = ALL_SERVICES
    grpc_address: str = DEFAULT_API_ADDRESS
    rest_address: str = "127.0.0.1:8080"
    metrics_address: str = ""
    # The internal services' own port (LifecycleManager, TrainingData, Scheduler): loopback,
    # any free port, unless peers on other machines must reach it (docs/security.md).
    internal_address: str = "127.0.0.1:0"
    # The TDS as learners reach it, where that differs from the internal address (pods on
    # Kubernetes reach it through a Service); empty: the internal address.
    learner_tds_address: str = ""
    # The service credential shared by daemons that host services for each other;
    # empty: <data dir>/internal.secret, generated 0600 on first start.
    internal_secret_file: str = ""
    # Mutual TLS on the internal port: the CA directory (ca.pem, ca.key, server.pem/key as
    # services/security/tls.py makes them) whose certificates every caller must present;
    # empty: plaintext. `rhizome up` passes its <data dir>/tls.
    internal_tls_dir: str = ""
    # TLS on the public gRPC port and the REST gateway (services/security/tls.py): a PEM
    # certificate chain and its key; both empty: plaintext.
    tls_cert: str = ""
    tls_key: str = ""
    # Where the other services are when they do not run in this process.
    peers: dict[str, str] = field(default_factory=dict)
    cluster_config: str = ""
    quota_config: str = ""
    # Authentication (services/api/auth.py, docs/security.md).
    trust_user_header: bool = False  # FfDL compatibility: believe x-rhizome-user; insecure
    auth_cache_s: float = 5.0  # how long a valid token lookup is reused
    # Submits in flight at once; beyond it a submit is refused with RESOURCE_EXHAUSTED /
    # 429 and a retry-after (services/api/shedding.py).
    max_submits_in_flight: int = 24
    admin_token_file: str = ""  # create an admin token here when there is none
    # Where learners run (services/backends): "local" processes or "docker" containers.
    backend: str = "local"
    # Where code archives and results live (services/objectstore, docs/backends.md):
    # "" = the volume `<data_dir>/objects`; a path = a (shared) volume there;
    # `s3://bucket[/prefix]` = an S3-compatible store at `object_store_endpoint`, which
    # learners reach with job-scoped credentials that expire after `storage_grant_ttl_s`.
    object_store: str = ""
    object_store_endpoint: str = ""
    storage_grant_ttl_s: float = 12 * 3600
    # Jobs whose guardians share one guardian host process (services/lcm/hosting.py's
    # --guardians-per-host, docs/control-plane-scale.md); 0: a guardian process per job;
    # None (a daemon built in-process): $RHIZOME_GUARDIANS_PER_HOST, else the default (100).
    guardians_per_host: int | None = None
    # The TTL of the daemon's leader lease (services/leader/etcd.py): a leader that could
    # not refresh it for 0.8 of it gives the role up (exits), and a standby on another
    # machine takes over after it. Longer rides out an etcd or daemon starved of CPU;
    # a standby on the same machine takes over at once either way.
    leader_lease_ttl_s: int = 2

    @property
    def internal_secret_path(self) -> Path:
        return Path(self.internal_secret_file or self.data_dir / "internal.secret")

    @property
    def objects_dir(self) -> Path:
        return self.data_dir / "objects"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host, int(port)
