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
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from contract import env as learner_env

# The TTL of a learner controller's etcd lease, which holds its status key
# (`jobs/<job>/learners/<rank>/status`): a controller whose machine is lost (or cut off
# from etcd) loses that key this long after its last refresh, and that deletion is how its
# guardian learns of it; a controller that crashes on a machine that still runs is
# noticed sooner where its guardian sees the process (the local backend's reaper).
# The controller refreshes it every TTL/4. The platform sets it for every learner
# (`RHIZOME_LEARNER_LEASE_TTL_S`, services/guardian/guardian.py; docs/lifecycle.md).
DEFAULT_LEARNER_LEASE_TTL_S = 10


class CommandOutput(StrEnum):
    """Where the user command's stdout and stderr go, and so who ships them to the TDS.

    One writer per record id (`{job}-{rank}-{stream}-{seq}`): either the controller's own
    collector tails files, or the platform reads the container's streams; never both.
    """

    # `<learner_dir>/{stdout,stderr}.log`, tailed and shipped by the controller's own
    # collector (the local backend: learners are processes of this machine).
    FILES = "files"
    # The controller's own stdout and stderr, i.e. the container's output streams, which
    # the engine keeps with a timestamp per line; the platform's per-job collector ships
    # them (the docker backend; learner/controller/container_logs.py). The controller's
    # own log goes to `controller.log`, so those streams are the command's alone.
    PASSTHROUGH = "passthrough"


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
    # Mutual TLS to the TDS's internal port when the platform serves it (`rhizome up`):
    # `{ca, cert, key}` PEM text, the job's own client certificate. Empty: plaintext.
    # Kept out of repr (the key); the spec file is 0600.
    tds_tls: dict[str, str] = field(default_factory=dict, repr=False)
    # The job's own etcd user, `USER:PASSWORD` (`contract.etcd.EtcdCredentials.parse`), whose
    # role covers only the job's prefix, when etcd requires authentication: the controller
    # authenticates with it and hands it to its command in a 0600 file
    # (`RHIZOME_ETCD_CREDENTIALS_FILE`). Kept out of repr; the spec file is 0600.
    etcd_credentials: str = field(default="", repr=False)
    metric_sources: Any = None  # the manifest's `evaluation_metrics`
    grace_s: float = 10.0  # SIGTERM -> SIGKILL on halt
    lease_ttl_s: int = DEFAULT_LEARNER_LEASE_TTL_S  # the platform's, in every spec
    # Where the code archive, checkpoints and results live when they are not files the
    # learner can open (an object store): a `StorageAccess` as a dict, with the job's
    # short-lived credentials. Empty: `model_zip` and `result_store` are paths.
    storage: dict[str, Any] = field(default_factory=dict)
    # A `CommandOutput` value: who ships the command's output (the backend decides).
    command_output: str = CommandOutput.FILES.value

    def __post_init__(self) -> None:
        if self.command_output not in tuple(CommandOutput):
            raise ValueError(
                f"command_output is {self.command_output!r}; use one of "
                + ", ".join(repr(o.value) for o in CommandOutput)
            )

    @property
    def passthrough(self) -> bool:
        """The command writes to the controller's own streams (a container's), not files."""
        return self.command_output == CommandOutput.PASSTHROUGH

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
        """Write atomically: a controller restarted meanwhile never reads half a spec.
        Mode 0600: the spec may carry the job's storage credentials."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        # Owner-only from the first byte: the spec carries the job's TDS token.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_json())
        tmp.replace(path)

    @property
    def storage_access(self) -> StorageAccess | None:
        return StorageAccess.from_dict(self.storage) if self.storage else None

    # -- where things are -----------------------------------------------------------------
    @property
    def learner_dir(self) -> Path:
        return learner_env.learner_dir(self.job_dir, self.rank)

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


@dataclass
class StorageAccess:
    """One job's access to the platform's object store, as a learner receives it.

    The credentials are the job's own (services/objectstore): session credentials that
    expire at `expires_at` and whose policy allows only `model_key` (read) and the
    `checkpoint_prefix` and `result_prefix` folders (read, write, delete, list).
    """

    kind: str  # "s3" (the only remote kind so far)
    endpoint_url: str
    bucket: str
    model_key: str  # the code archive; "" when the job has none
    checkpoint_prefix: str  # <store prefix>/checkpoints: the checkpoint SDK adds job/learner
    result_prefix: str  # <store prefix>/results/<job>: the controller adds the rank
    access_key_id: str
    secret_access_key: str
    session_token: str
    expires_at: float  # seconds since the epoch
    region: str = "us-east-1"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StorageAccess:
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown storage fields {', '.join(unknown)}")
        return cls(**data)

    @property
    def expired(self) -> bool:
        return time.time() >= self.expires_at

    @property
    def checkpoint_url(self) -> str:
        """What the checkpoint SDK takes as `RHIZOME_BACKUP_URL`."""
        return f"s3://{self.bucket}/{self.checkpoint_prefix}"

    def aws_environ(self) -> dict[str, str]:
        """The standard variables boto3 reads: the job's credentials, nothing else."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_SESSION_TOKEN": self.session_token,
            "AWS_DEFAULT_REGION": self.region,
        }

    def redacted(self) -> dict[str, Any]:
        """For logs and errors: everything but the secret and the token."""
        out = self.to_dict()
        out["secret_access_key"] = out["session_token"] = "***"
        return out
