"""How the daemon hosts the training data service (logs and metrics in Elasticsearch)."""

from __future__ import annotations

import os

from rhizome.v1 import tds_pb2

from services.hosting import DaemonContext, Hosted, jobs_repository
from services.security.internal import job_scope
from services.store import states
from services.store.errors import JobNotFound
from services.tds.checkpoints import CheckpointReports
from services.tds.last_metrics import DEFAULT_INTERVAL_S, LastMetrics
from services.tds.server import add_to_server

# How long a deleted job's logs and metrics stay searchable (RHIZOME_LOG_RETENTION_S).
DEFAULT_RETENTION_S = 24 * 3600.0


def build(ctx: DaemonContext) -> Hosted:
    """Host TrainingData; follow streams end when the job's record says it ended."""
    if not ctx.config.elasticsearch_url:
        from click import UsageError

        raise UsageError(
            "the tds needs Elasticsearch: pass --elasticsearch-url or set RHIZOME_ELASTICSEARCH_URL"
        )
    jobs = jobs_repository(ctx)

    def job_finished(job_id: str) -> bool:
        try:
            status = jobs.get(job_id).status
        except JobNotFound:
            return True
        # A halted job's stream ends too: nothing prints until it is resumed.
        return states.is_terminal(status) or status == states.HALTED

    # Each job's newest metric values onto its record, for the jobs list (last_metrics.py).
    last = LastMetrics(
        jobs.set_last_metrics,
        float(os.environ.get("RHIZOME_LAST_METRICS_S", DEFAULT_INTERVAL_S)),
    )
    last.start()

    servicer = add_to_server(
        ctx.server,
        es_url=ctx.config.elasticsearch_url,
        job_finished=job_finished,
        retention_s=float(os.environ.get("RHIZOME_LOG_RETENTION_S", DEFAULT_RETENTION_S)),
        # A learner's job token reaches its own job only (services/security/internal.py).
        job_scope=lambda context: job_scope(ctx.credentials, context),
        on_metrics=last.observe,
        # Checkpoints the learners report in their stderr onto the record (checkpoints.py).
        on_logs=CheckpointReports(jobs.add_checkpoints).observe,
    )
    name = tds_pb2.DESCRIPTOR.services_by_name["TrainingData"].full_name

    def close() -> None:
        servicer.close()
        last.close()

    return Hosted([name], None, close)
