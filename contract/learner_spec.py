"""The learner spec: what the guardian (through a backend) tells one learner controller.

A backend writes it as `<job_dir>/learners/<rank>/spec.json` and starts
`python -m learner.controller --spec PATH`; the controller reads it back. Unknown fields
are refused, so the two sides cannot silently disagree about the format.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contract import env as learner_env


@dataclass
class LearnerSpec:
    job_id: str
    rank: int
    world_size: int
    job_dir: str
    command: str  # a shell command line, run in the job's code directory
    etcd_url: str
    generation: int = 1  # deploy generation: a restarted controller of the same one adopts
    restart: int = 0  # learner restarts within the generation
    env: dict[str, str] = field(default_factory=dict)  # the command's `LearnerEnv` and more
    model_zip: str = ""
    data_stores: list[dict[str, Any]] = field(default_factory=list)
    result_store: str = ""
    tds_address: str = ""
    # The job token the collector sends to the TDS (contract/credentials.py): it may append
    # to and read this job's logs only. Kept out of repr; the spec file is 0600.
    tds_token: str = field(default="", repr=False)
    metric_sources: Any = None  # the manifest's `evaluation_metrics`
    grace_s: float = 10.0  # SIGTERM -> SIGKILL on halt
    lease_ttl_s: int = 2

    # -- wire format ----------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes, where: str = "spec") -> LearnerSpec:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a learner spec is a JSON object")
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"{where}: unknown spec fields {', '.join(unknown)}")
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> LearnerSpec:
        return cls.from_json(Path(path).read_text(), where=str(path))

    def dump(self, path: Path) -> None:
        """Write atomically: a controller restarted meanwhile never reads half a spec."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        # Owner-only from the first byte: the spec carries the job's TDS token.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        tmp.replace(path)

    # -- where things are -----------------------------------------------------------------
    @property
    def learner_dir(self) -> Path:
        return Path(self.job_dir) / "learners" / str(self.rank)

    @property
    def code_dir(self) -> Path:
        return Path(self.job_dir) / "code"

    @property
    def result_dir(self) -> Path:
        return Path(self.env.get(learner_env.RESULT_DIR) or Path(self.job_dir) / "results")

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.env.get(learner_env.CHECKPOINT_DIR) or Path(self.job_dir) / "checkpoints")

    @property
    def incarnation(self) -> list[int]:
        return [self.generation, self.restart]
