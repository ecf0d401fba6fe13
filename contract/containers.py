"""How a learner container is known on a Docker engine: the labels the docker backend puts
on it, which the per-job log collector (learner/controller/container_logs.py, started by
module name) uses to find a job's containers rank by rank."""

from __future__ import annotations

LABEL_JOB = "rhizome.job"
LABEL_RANK = "rhizome.rank"
LABEL_GENERATION = "rhizome.generation"
LABEL_RESTART = "rhizome.restart"


def label_filter(job_id: str, rank: int | None = None) -> dict[str, list[str]]:
    """The engine's label filter for a job's objects (and one rank's containers)."""
    wanted = [f"{LABEL_JOB}={job_id}"]
    if rank is not None:
        wanted.append(f"{LABEL_RANK}={rank}")
    return {"label": wanted}


# The job's container log collector (a process of the platform's host, one per job): the
# file in its state directory it holds an flock on while it runs (its pid and start time
# inside), and the variable that carries the job's TDS token to it (never argv).
COLLECTOR_LOCK_FILE = "collector.lock"
COLLECTOR_TOKEN_ENV = "RHIZOME_TDS_TOKEN"
# ...and the job's mutual-TLS client certificate for the TDS (JSON `{ca, cert, key}`,
# LearnerSpec.tds_tls), on a platform whose internal port serves TLS.
COLLECTOR_TLS_ENV = "RHIZOME_TDS_TLS"
