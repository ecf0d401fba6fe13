"""Concurrent-client load and its percentiles, shared by the submit benchmarks
(api_submit.py, security_overhead.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_clients(
    clients: int, per_client: int, submit: Callable[[int, int], object]
) -> tuple[float, list[float]]:
    """`clients` threads, each calling `submit(client, i)` for i < `per_client`; the wall
    time of the whole run and every call's latency. The first error of any client is
    raised once all have stopped."""
    latencies: list[float] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(cid: int) -> None:
        mine = []
        try:
            for i in range(per_client):
                t0 = time.perf_counter()
                submit(cid, i)
                mine.append(time.perf_counter() - t0)
        except BaseException as exc:
            errors.append(exc)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed, latencies
