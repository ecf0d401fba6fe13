"""Stand-in placement until the scheduler service is wired in: when the daemon hosts no
scheduler, the LCM itself moves QUEUED jobs to PENDING with every learner on the local
machine. The scheduler loop replaces exactly this function and nothing else."""

from __future__ import annotations

import logging
import time

from services.store import states
from services.store.errors import StaleToken
from services.store.jobs import JobsRepository

log = logging.getLogger("rhizome.lcm")

LOCAL_NODE = "local"


def place_queued_locally(jobs: JobsRepository, limit: int = 50) -> list[str]:
    """Promote QUEUED jobs, oldest first, to PENDING on node "local"; returns their ids."""
    placed = []
    for job in jobs.by_status([states.QUEUED], limit=limit):
        learners = int(job.resources["learners"])  # the job's current size (scale changes it)
        placement = {
            "learner_nodes": {str(rank): LOCAL_NODE for rank in range(learners)},
            "placed_at": time.time(),
        }
        try:
            jobs.transition(
                job.job_id,
                states.PENDING,
                "placed on the local machine (no scheduler)",
                expect_version=job.version,
                placement=placement,
            )
        except (StaleToken, states.IllegalTransition):
            continue  # someone else moved it (a halt, a delete): their write wins
        placed.append(job.job_id)
    return placed
