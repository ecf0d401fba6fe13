"""How the daemon hosts the training data service (logs and metrics in Elasticsearch)."""

from __future__ import annotations

import os

from rhizome.v1 import tds_pb2

from services.hosting import DaemonContext, Hosted, jobs_repository
from services.security.internal import job_scope
from services.store import states
from services.store.errors import JobNotFound
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

    servicer = add_to_server(
        ctx.server,
        es_url=ctx.config.elasticsearch_url,
        job_finished=job_finished,
        retention_s=float(os.environ.get("RHIZOME_LOG_RETENTION_S", DEFAULT_RETENTION_S)),
        # A learner's job token reaches its own job only (services/security/internal.py).
        job_scope=lambda context: job_scope(ctx.credentials, context),
    )
    name = tds_pb2.DESCRIPTOR.services_by_name["TrainingData"].full_name
    return Hosted([name], None, servicer.close)
