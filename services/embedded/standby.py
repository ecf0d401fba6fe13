"""A hot standby daemon (`rhizomed --standby`) managed like the active one: its own log
and state file beside the active daemon's, the same data directory (job directories,
the internal port it adopts at takeover), ready once its health says it is a warm
standby (or, when it already leads, SERVING)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.embedded.platform import DaemonServer

# services/daemon.py STANDBY_HEALTH_NAME (not imported: that would load the daemon here).
STANDBY_HEALTH_NAME = "rhizome.Standby"


def health_of(address: str, service: str, tls: bool, ca: bytes | None) -> bool:
    if tls:
        channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca))
    else:
        channel = grpc.insecure_channel(address)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=0.5)
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)
    except grpc.RpcError:
        return False
    finally:
        channel.close()


class StandbyDaemonServer(DaemonServer):
    name = "rhizomed-standby"

    def argv(self) -> list[str]:
        return [*super().argv(), "--standby"]

    def healthy(self) -> bool:
        tls = self.tls is not None and self.tls.enabled
        ca = self.tls.ca_bytes() if tls and self.tls else None
        return health_of(self.url, STANDBY_HEALTH_NAME, tls, ca) or health_of(self.url, "", tls, ca)
