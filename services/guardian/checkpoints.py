"""The guardian tells the scheduler when the job last saved, so that a preemption picks
the victim that loses the least work (issue #19; docs/elastic.md).

Every `INTERVAL_S` the guardian reads the newest committed checkpoint under the job's
checkpoint directory (`contract.checkpoints.newest_commit`) and, when it is newer than the
one reported, writes it to the job's record as `placement.last_checkpoint` =
`{"at": <commit time>, "step": <step>}`; the scheduling loop passes it on
(`GangScheduler.note_checkpoint`).
"""

from __future__ import annotations

import logging
import time

from contract.checkpoints import newest_commit
from services.store.errors import JobNotFound
from services.store.jobs import JobsRepository

log = logging.getLogger("rhizome.guardian.checkpoints")

INTERVAL_S = 5.0


class CheckpointReporter:
    def __init__(self, jobs: JobsRepository, job_id: str, checkpoint_dir: str) -> None:
        self.jobs = jobs
        self.job_id = job_id
        self.checkpoint_dir = checkpoint_dir
        self.reported = 0.0
        self.checked_at = -INTERVAL_S

    def poll(self) -> None:
        """Report a newer commit; at most once per `INTERVAL_S` (a directory scan)."""
        now = time.monotonic()
        if now - self.checked_at < INTERVAL_S:
            return
        self.checked_at = now
        commit = newest_commit(self.checkpoint_dir)
        if commit is None or commit.committed_at <= self.reported:
            return
        try:
            self.jobs.update_fields(
                self.job_id,
                **{"placement.last_checkpoint": {"at": commit.committed_at, "step": commit.step}},
            )
        except JobNotFound:
            return
        self.reported = commit.committed_at
        log.info("job %s: last checkpoint at step %d", self.job_id, commit.step)
