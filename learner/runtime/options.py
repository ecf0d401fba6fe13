"""How one pipeline worker is configured: ``WorkerOptions`` and test-only ``KillPoint``s."""

from __future__ import annotations

from dataclasses import dataclass, field

from learner.runtime.api import ConfigError
from learner.runtime.schedule import Op

# Not an instruction of a step: the moment a worker of generation 0 has registered and is
# about to build its links (engine.py `_start`), where a loss must fail over like any other.
LINK_KILL_POINT = "link"


@dataclass(frozen=True)
class KillPoint:
    """Make ``worker`` SIGKILL itself before ``op`` of ``microbatch`` (-1: any) at ``step``."""

    worker: int
    step: int
    op: str
    microbatch: int = -1

    @classmethod
    def parse(cls, spec: str) -> list[KillPoint]:
        out = []
        for part in filter(None, spec.split(",")):
            fields = part.split(":")
            if len(fields) not in (3, 4):
                raise ConfigError(
                    f"kill point {part!r}: expected worker:step:op[:microbatch], e.g. 1:2:forward:0"
                )
            ops = [o.value for o in Op] + [LINK_KILL_POINT]
            if fields[2] not in ops:
                raise ConfigError(
                    f"kill point {part!r}: op {fields[2]!r} is unknown; use one of {', '.join(ops)}"
                )
            m = int(fields[3]) if len(fields) == 4 else -1
            out.append(cls(int(fields[0]), int(fields[1]), fields[2], m))
        return out


@dataclass
class WorkerOptions:
    worker: int
    stages: int
    pipelines: int
    backend: str = "gloo"
    device: str = "cpu"
    # Where this worker's process groups accept connections: its own address on the route
    # to the rendezvous (127.0.0.1 on one machine), never every interface.
    address: str = "127.0.0.1"
    detection_timeout_s: float = 5.0
    lease_ttl_s: float = 2.0
    poll_s: float = 0.05
    out_dir: str | None = None
    kill: list[KillPoint] = field(default_factory=list)
    verbose: bool = True
    startup_timeout_s: float = 120.0
    # set for a replacement admitted into a running job (reconfigure.py)
    join_token: str | None = None
    # block checkpoints every `checkpoint_every` steps (block_checkpoint.py); None: off
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    # where each ended step's metrics go (step_metrics.py); None: nowhere
    metrics_file: str | None = None
    metrics_every: int = 1  # one metrics line per this many steps (step_metrics.py)
