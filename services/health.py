"""The daemon's gRPC health status, kept true to its stores (issue #15).

Every hosted service reads and writes MongoDB, and the lifecycle manager etcd; a daemon
whose client of either cannot reach its server cannot do its work, whatever its gRPC
server says. `HealthMonitor` probes the very clients the services use (a MongoDB `ping`
on the shared database, an etcd read on the LCM's client) every `interval_s` in a thread
of its own, and sets every hosted service (and the server as a whole, "") NOT_SERVING
while a probe fails, SERVING again once all pass. The clients reconnect by themselves
(pymongo's topology monitor, the etcd client's gRPC channel), so coming back needs no
restart. `rhizome_store_up{store}` exposes the same verdicts as metrics.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from grpc_health.v1 import health, health_pb2

from services.hosting import DaemonContext
from services.metrics import STORE_UP

log = logging.getLogger(__name__)

Probe = Callable[[], None]  # returns when the store answered, raises otherwise

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

# A key nobody writes: reading it exercises the client and the server, nothing more.
ETCD_PROBE_KEY = "/rhizome/health-probe"


def store_probes(ctx: DaemonContext) -> dict[str, Probe]:
    """Probes of the store clients this daemon's services hold."""
    probes: dict[str, Probe] = {}
    db = ctx.shared.get("db")
    if db is not None:

        def mongodb() -> None:
            db.client.admin.command("ping")

        probes["mongodb"] = mongodb
    lcm = ctx.shared.get("lcm")
    etcd = getattr(lcm, "etcd", None)
    if etcd is not None:

        def etcd_read() -> None:
            etcd.get(ETCD_PROBE_KEY)

        probes["etcd"] = etcd_read
    return probes


class HealthMonitor:
    """Sets `names` (and "") SERVING or NOT_SERVING on `servicer` from `probes`."""

    def __init__(
        self,
        servicer: health.HealthServicer,
        names: Iterable[str],
        probes: dict[str, Probe],
        interval_s: float = 1.0,
    ) -> None:
        self.servicer = servicer
        self.names = ["", *names]
        self.probes = probes
        self.interval_s = interval_s
        self.failing: dict[str, str] = {}  # store -> why its last probe failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> dict[str, str]:
        """Probe every store once and publish the verdict; returns the failing ones."""
        failing: dict[str, str] = {}
        for store, probe in self.probes.items():
            try:
                probe()
            except Exception as exc:  # any failure of the client means not serving
                failing[store] = f"{type(exc).__name__}: {exc}"[:300]
            STORE_UP.labels(store=store).set(0 if store in failing else 1)
        for store in failing.keys() - self.failing.keys():
            log.warning("health: %s unreachable, NOT_SERVING (%s)", store, failing[store])
        for store in self.failing.keys() - failing.keys():
            log.info("health: %s reachable again", store)
        self.failing = failing
        status = NOT_SERVING if failing else SERVING
        for name in self.names:
            self.servicer.set(name, status)
        return failing

    def start(self) -> HealthMonitor:
        self._thread = threading.Thread(target=self._run, name="health-monitor", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a monitor bug must not end monitoring
                self.check()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)


def start_health_monitor(
    ctx: DaemonContext, servicer: Any, names: Iterable[str], interval_s: float = 1.0
) -> HealthMonitor:
    """The daemon's hook: monitor the stores its services use, from now on."""
    return HealthMonitor(servicer, names, store_probes(ctx), interval_s).start()


__all__ = ["HealthMonitor", "start_health_monitor", "store_probes"]
