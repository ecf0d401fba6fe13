"""Running the TDS: `add_to_server` for the daemon, `serve`/`main` for `python -m services.tds`."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from typing import Any

import grpc
from rhizome.v1 import tds_pb2_grpc

from services import metrics
from services.rpc_guard import MalformedRequestInterceptor
from services.tds.api import StoreUnavailable, TrainingDataStore, create_store
from services.tds.servicer import JobFinished, TrainingDataServicer

log = logging.getLogger(__name__)
DEFAULT_ES_URL = "http://127.0.0.1:9200"


def ensure_schema(store: TrainingDataStore, timeout_s: float = 30.0) -> None:
    """Create the index templates, waiting for a search server that is still starting."""
    deadline = time.monotonic() + timeout_s
    delay = 0.1
    while True:
        try:
            store.ensure_schema()
            return
        except StoreUnavailable as exc:
            if time.monotonic() >= deadline:
                raise StoreUnavailable(
                    f"{exc}; is Elasticsearch running? Set ELASTICSEARCH_URL or --es-url"
                ) from exc
            time.sleep(delay)
            delay = min(delay * 2, 2.0)


def add_to_server(
    server: grpc.Server,
    store: TrainingDataStore | None = None,
    *,
    es_url: str | None = None,
    job_finished: JobFinished | None = None,
    retention_s: float = 0.0,
    start_sweeper: bool = True,
    **servicer_kwargs: Any,
) -> TrainingDataServicer:
    """Register the TrainingData servicer on `server` and return it (call `.close()` on
    shutdown). Without `store`, an Elasticsearch store at `es_url` (or $ELASTICSEARCH_URL)."""
    if store is None:
        store = create_store(
            "elasticsearch", url=es_url or os.environ.get("ELASTICSEARCH_URL", DEFAULT_ES_URL)
        )
    ensure_schema(store)
    servicer = TrainingDataServicer(store, job_finished, retention_s=retention_s, **servicer_kwargs)
    tds_pb2_grpc.add_TrainingDataServicer_to_server(servicer, server)
    if start_sweeper:
        servicer.start_sweeper()
    return servicer


def serve(
    address: str,
    store: TrainingDataStore,
    *,
    job_finished: JobFinished | None = None,
    retention_s: float = 0.0,
    max_workers: int = 64,
    **servicer_kwargs: Any,
) -> tuple[grpc.Server, TrainingDataServicer, int]:
    """Start a gRPC server with the TDS alone; returns (server, servicer, bound port)."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="tds"),
        interceptors=[metrics.GrpcMetricsInterceptor(), MalformedRequestInterceptor()],
        options=[("grpc.max_receive_message_length", 64 * 1024 * 1024)],
    )
    servicer = add_to_server(
        server, store, job_finished=job_finished, retention_s=retention_s, **servicer_kwargs
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind the TDS to {address!r}: is the port in use?")
    server.start()
    return server, servicer, port


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.tds", description="Serve rhizome.v1.TrainingData alone."
    )
    parser.add_argument("--address", default="127.0.0.1:0", help="host:port to listen on")
    parser.add_argument(
        "--es-url",
        default=os.environ.get("ELASTICSEARCH_URL", DEFAULT_ES_URL),
        help="Elasticsearch URL (default $ELASTICSEARCH_URL or %(default)s)",
    )
    parser.add_argument("--store", default="elasticsearch", choices=["elasticsearch", "memory"])
    parser.add_argument(
        "--retention-s", type=float, default=0.0, help="delay before DeleteJobData deletes"
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve /metrics here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s tds %(levelname)s %(message)s")

    store = (
        create_store("memory")
        if args.store == "memory"
        else create_store("elasticsearch", url=args.es_url)
    )
    try:
        server, servicer, port = serve(args.address, store, retention_s=args.retention_s)
    except (StoreUnavailable, OSError) as exc:
        print(f"tds: {exc}", file=sys.stderr)
        return 2
    if args.metrics_port is not None:
        metrics.serve_metrics(args.metrics_port)
    host = args.address.rsplit(":", 1)[0]
    # The one line tests and launchers wait for.
    print(f"tds listening on {host}:{port}", flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()
    servicer.close()
    server.stop(grace=2).wait()
    store.close()
    return 0
