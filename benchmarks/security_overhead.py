"""What TLS + bearer-token authentication cost a submit, against plaintext without auth.

One run starts one MongoDB-wire server and two daemons hosting the submit path
(`--services api,scheduler`, each its own process and database):
- **secure**: TLS on gRPC and REST (a certificate of a local CA, as `rhizome up` makes),
  every call with a bearer token (the daemon's default);
- **plain**: no TLS, `--insecure-trust-user-header` (the FfDL-era user header, no token).
C concurrent clients per configuration (one SDK client or HTTP client each, kept open as
real clients do) submit N jobs each way; the configurations alternate round by round, so
a noisy neighbour hits both alike. Printed: submits/s and p50/p99 latency per
configuration and protocol, and secure / plain ratios (goal: at most 10 % slower).

Wall-clock throughput on a shared, overloaded machine swings by more than the effect, so
the run also measures CPU time per submit — the daemon's (from /proc/PID/stat) and the
clients' (this process) — which contention disturbs far less: on a saturated server,
throughput goes as one over the CPU a request costs.

    .venv/bin/python benchmarks/security_overhead.py [--jobs 300] [--clients 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "gen")]

import httpx  # noqa: E402
from _load import percentile, run_clients  # noqa: E402

from contract.procs import free_port  # noqa: E402
from services.client.sdk import Client  # noqa: E402
from services.embedded.platform import DaemonServer, TlsChoice  # noqa: E402
from services.embedded.servers import MongoServer  # noqa: E402
from services.store.mongo import connect  # noqa: E402
from services.store.tokens import TokensRepository  # noqa: E402

MANIFEST = "name: bench\nlearners: 1\nframework:\n  command: python train.py\n"
CONFIGS = ("plain", "secure")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Deployment:
    """One daemon of one configuration, and its clients."""

    def __init__(self, name: str, mongo: MongoServer, data_dir: Path, clients: int) -> None:
        self.name = name
        self.secure = name == "secure"
        uri = mongo.url.replace("/?", f"/bench_{name}?")
        args = [f"--mongodb-uri={uri}", "--services=api,scheduler", "--metrics-address="]
        tls = TlsChoice(plaintext=not self.secure).prepare(data_dir)
        if not self.secure:
            args.append("--insecure-trust-user-header")
        self.daemon = DaemonServer(data_dir, free_port(), free_port(), args, tls)
        self.daemon.start()
        users = [f"bench-{name}-{uuid.uuid4().hex[:6]}" for _ in range(clients)]
        tokens = TokensRepository(connect(uri))
        if self.secure:
            secrets = [tokens.create(u, created_by="benchmark").secret for u in users]
            self.grpc = [Client(self.daemon.url, token=s, ca_file=tls.ca) for s in secrets]
            context = ssl.create_default_context(cafile=tls.ca)
            self.http = [
                httpx.Client(
                    base_url=f"https://127.0.0.1:{self.daemon.rest_port}",
                    headers={"Authorization": f"Bearer {s}"},
                    verify=context,
                    timeout=30,
                )
                for s in secrets
            ]
        else:
            self.grpc = [Client(self.daemon.url, user=u, token="", tls=False) for u in users]
            self.http = [
                httpx.Client(
                    base_url=f"http://127.0.0.1:{self.daemon.rest_port}",
                    headers={"X-Rhizome-User": u},
                    timeout=30,
                )
                for u in users
            ]
        self.submitted = 0

    def grpc_submit(self, cid: int, _i: int) -> None:
        self.grpc[cid].create_job(MANIFEST)

    def rest_submit(self, cid: int, _i: int) -> None:
        files = {"manifest": ("manifest.yml", MANIFEST.encode())}
        self.http[cid].post("/v1/models", files=files).raise_for_status()

    def stored(self) -> int:
        return sum(len(list(c.iter_jobs())) for c in self.grpc)

    def close(self) -> None:
        for c in self.grpc:
            c.close()
        for h in self.http:
            h.close()
        self.daemon.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--jobs", type=int, default=300, help="submits per protocol, configuration and round"
    )
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()
    per_client = max(1, args.jobs // args.clients)
    total = per_client * args.clients
    # (config, protocol) -> per-round throughputs, and all latencies; per protocol, each
    # round's secure/plain throughput ratio (measured back to back, so a load spike on the
    # shared machine tends to hit one pair, not one configuration throughout)
    rates: dict[tuple[str, str], list[float]] = {}
    paired: dict[str, list[float]] = {}
    # (config, protocol) -> per-round CPU milliseconds per submit: daemon, clients
    daemon_cpu: dict[tuple[str, str], list[float]] = {}
    client_cpu: dict[tuple[str, str], list[float]] = {}
    lats: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="rz-secbench-") as tmp:
        root = Path(tmp)
        mongo = MongoServer(root / "mongo")
        mongo.start()
        deployments: dict[str, Deployment] = {}
        try:
            for name in CONFIGS:
                deployments[name] = Deployment(name, mongo, root / name, args.clients)
            # A warm-up round per configuration (connections, handshakes, caches), unmeasured.
            for d in deployments.values():
                run_clients(args.clients, 5, d.grpc_submit)
                run_clients(args.clients, 5, d.rest_submit)
                d.submitted += 10 * args.clients
            for rnd in range(args.rounds):
                order = CONFIGS if rnd % 2 == 0 else tuple(reversed(CONFIGS))
                for name in order:
                    d = deployments[name]
                    for protocol, fn in (("gRPC", d.grpc_submit), ("REST", d.rest_submit)):
                        assert d.daemon.pid is not None
                        cpu0, own0 = cpu_seconds(d.daemon.pid), time.process_time()
                        elapsed, lat = run_clients(args.clients, per_client, fn)
                        cpu1, own1 = cpu_seconds(d.daemon.pid), time.process_time()
                        daemon_cpu.setdefault((name, protocol), []).append(
                            1000 * (cpu1 - cpu0) / total
                        )
                        client_cpu.setdefault((name, protocol), []).append(
                            1000 * (own1 - own0) / total
                        )
                        rates.setdefault((name, protocol), []).append(total / elapsed)
                        lats.setdefault((name, protocol), []).extend(lat)
                        d.submitted += total
                for protocol in ("gRPC", "REST"):
                    pair = rates[("secure", protocol)][-1] / rates[("plain", protocol)][-1]
                    paired.setdefault(protocol, []).append(pair)
                print(f"  round {rnd + 1}/{args.rounds} done", file=sys.stderr)
            for d in deployments.values():
                assert d.stored() == d.submitted, f"{d.name}: {d.stored()} of {d.submitted} stored"
        finally:
            for d in deployments.values():
                d.close()
            mongo.stop()
    results: dict[str, dict[str, float]] = {}
    print(
        f"\n{total} submits per protocol, configuration and round, {args.rounds} rounds "
        f"alternating, {args.clients} clients, daemon hosting api,scheduler, "
        f"{os.cpu_count()} cores shared by clients, daemons and the database"
    )
    print(
        f"{'configuration':<34}{'submits/s':>11}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'daemon CPU ms':>15}{'client CPU ms':>15}"
    )
    for protocol in ("gRPC", "REST"):
        for name in CONFIGS:
            key = (name, protocol)
            label = f"{protocol} {'TLS + token' if name == 'secure' else 'plaintext, no auth'}"
            row = {
                "submits_per_s": statistics.median(rates[key]),
                "p50_ms": 1000 * percentile(lats[key], 0.5),
                "p99_ms": 1000 * percentile(lats[key], 0.99),
                "daemon_cpu_ms": statistics.median(daemon_cpu[key]),
                "client_cpu_ms": statistics.median(client_cpu[key]),
            }
            results[f"{protocol} {name}"] = row
            print(
                f"{label:<34}{row['submits_per_s']:>11.0f}{row['p50_ms']:>9.1f}"
                f"{row['p99_ms']:>9.1f}{row['daemon_cpu_ms']:>15.2f}{row['client_cpu_ms']:>15.2f}"
            )
        secure, plain = results[f"{protocol} secure"], results[f"{protocol} plain"]
        slower = 1 - statistics.median(paired[protocol])
        p99 = secure["p99_ms"] / plain["p99_ms"]
        cpu = secure["daemon_cpu_ms"] / plain["daemon_cpu_ms"]
        results[f"{protocol} ratio"] = {
            "throughput_slower": slower,
            "p99_ratio": p99,
            "daemon_cpu_ratio": cpu,
        }
        rounds = ", ".join(f"{100 * (1 - r):+.0f}" for r in paired[protocol])
        print(
            f"  {protocol}: TLS + token costs {100 * slower:+.1f} % of plain's throughput "
            f"(median of the rounds' paired ratios: {rounds} %; goal <= 10 %), p99 x{p99:.2f}, "
            f"daemon CPU per submit x{cpu:.2f} ({100 * (1 - 1 / cpu):+.1f} % of a saturated "
            "daemon's throughput)"
        )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
