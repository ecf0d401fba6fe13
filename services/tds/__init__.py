"""Training data service: log lines and metrics in, search and follow streams out.

The daemon calls `add_to_server(server, es_url=..., job_finished=..., retention_s=...)`;
`python -m services.tds` serves it alone. See docs/logs-and-metrics.md.
"""

from services.tds.server import add_to_server

__all__ = ["add_to_server"]
