"""What TLS + bearer-token authentication cost a submit, against plaintext without auth.

One run starts one MongoDB-wire server and two daemons hosting the submit path
(`--services api,scheduler`, each its own process and database):
- **secure**: TLS on gRPC and REST (a certificate of a local CA, as `rhizome up` makes),
  every call with a bearer token (the daemon's default);
- **plain**: no TLS, `--insecure-trust-user-header` (the FfDL-era user header, no token).
C concurrent clients per configuration (one SDK client or HTTP client each, kept open as
real clients do: the run counts the REST clients' TLS handshakes in the measured window,
which is 0 when every submit rides a kept-alive connection) submit N jobs per round. The
rounds interleave the configurations back to back, the order flipping every round (ABBA),
so a noisy neighbour hits both of a pair alike; each round gives one secure / plain ratio
of time per submit and of the daemon's CPU per submit (from /proc/PID/stat, which
contention disturbs far less than wall-clock time: on a saturated server, throughput goes
as one over the CPU a request costs). Printed: submits/s, p50/p99 latency and CPU per
configuration, and per ratio its median over the rounds with a 95 % confidence interval
(order statistics, no assumption on the noise's distribution), the quartiles and the
range, and a verdict against the goal (x1.10): MET when the whole interval is within it,
MISSED when the whole interval is beyond it, else UNRESOLVED (run more rounds).

    .venv/bin/python benchmarks/security_overhead.py [--jobs 100] [--clients 4] [--rounds 12]
        [--protocols gRPC,REST]
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
from _stats import median_interval, quartiles, verdict  # noqa: E402

from contract.procs import free_port  # noqa: E402
from services.client.sdk import Client  # noqa: E402
from services.embedded.platform import DaemonServer, TlsChoice  # noqa: E402
from services.embedded.servers import MongoServer  # noqa: E402
from services.store.mongo import connect  # noqa: E402
from services.store.tokens import TokensRepository  # noqa: E402

MANIFEST = "name: bench\nlearners: 1\nframework:\n  command: python train.py\n"
CONFIGS = ("plain", "secure")
GOAL = 1.10  # issue #15: TLS + auth at most 10 % slower than plaintext without


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
            # Kept to count the handshakes its clients make (`rest_handshakes`).
            self.rest_tls: ssl.SSLContext | None = context
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
            self.rest_tls = None
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

    def rest_handshakes(self) -> int:
        """TLS handshakes the REST clients have started so far (0 in plaintext): a
        kept-alive client makes one per connection, not one per request."""
        return 0 if self.rest_tls is None else int(self.rest_tls.session_stats()["connect"])

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
        "--jobs", type=int, default=100, help="submits per protocol, configuration and round"
    )
    parser.add_argument("--clients", type=int, default=4, help="concurrent clients")
    parser.add_argument("--rounds", type=int, default=12, help="interleaved rounds")
    parser.add_argument(
        "--protocols",
        default="gRPC,REST",
        help="comma-separated, of gRPC and REST (default both)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = set(protocols) - {"gRPC", "REST"}
    if unknown or not protocols:
        parser.error(f"--protocols: {sorted(unknown) or 'none'} not known; use gRPC, REST or both")
    per_client = max(1, args.jobs // args.clients)
    total = per_client * args.clients
    # (config, protocol) -> per-round throughputs, per-round daemon and client CPU
    # milliseconds per submit, and all latencies. Per protocol, each round's secure/plain
    # ratios: the two configurations run back to back (ABBA: the order flips every round),
    # so a load spike on the shared machine tends to hit one pair, not one configuration.
    rates: dict[tuple[str, str], list[float]] = {}
    daemon_cpu: dict[tuple[str, str], list[float]] = {}
    client_cpu: dict[tuple[str, str], list[float]] = {}
    lats: dict[tuple[str, str], list[float]] = {}
    slowdown: dict[str, list[float]] = {p: [] for p in protocols}  # plain rate / secure rate
    cpu_ratio: dict[str, list[float]] = {p: [] for p in protocols}  # secure / plain daemon CPU
    handshakes = 0
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
            secure = deployments["secure"]
            handshakes_before = secure.rest_handshakes()
            for rnd in range(args.rounds):
                order = CONFIGS if rnd % 2 == 0 else tuple(reversed(CONFIGS))
                for protocol in protocols:
                    for name in order:
                        d = deployments[name]
                        fn = d.grpc_submit if protocol == "gRPC" else d.rest_submit
                        assert d.daemon.pid is not None
                        cpu0, own0 = cpu_seconds(d.daemon.pid), time.process_time()
                        elapsed, lat = run_clients(args.clients, per_client, fn)
                        cpu1, own1 = cpu_seconds(d.daemon.pid), time.process_time()
                        key = (name, protocol)
                        daemon_cpu.setdefault(key, []).append(1000 * (cpu1 - cpu0) / total)
                        client_cpu.setdefault(key, []).append(1000 * (own1 - own0) / total)
                        rates.setdefault(key, []).append(total / elapsed)
                        lats.setdefault(key, []).extend(lat)
                        d.submitted += total
                    s, p = ("secure", protocol), ("plain", protocol)
                    slowdown[protocol].append(rates[p][-1] / rates[s][-1])
                    cpu_ratio[protocol].append(daemon_cpu[s][-1] / daemon_cpu[p][-1])
                print(f"  round {rnd + 1}/{args.rounds} done", file=sys.stderr)
            handshakes = secure.rest_handshakes() - handshakes_before
            for d in deployments.values():
                assert d.stored() == d.submitted, f"{d.name}: {d.stored()} of {d.submitted} stored"
        finally:
            for d in deployments.values():
                d.close()
            mongo.stop()
    results: dict[str, dict[str, float]] = {}
    print(
        f"\n{total} submits per protocol, configuration and round, {args.rounds} rounds "
        f"interleaved (ABBA), {args.clients} clients each keeping one connection, daemon "
        f"hosting api,scheduler, {os.cpu_count()} cores shared by clients, daemons and the "
        f"database; load average at the end {os.getloadavg()[0]:.1f}"
    )
    if "REST" in protocols:
        print(
            f"TLS handshakes by the REST clients during the measured rounds: {handshakes} "
            "(0: every submit rode a kept-alive connection)"
        )
    print(
        f"{'configuration':<34}{'submits/s':>11}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'daemon CPU ms':>15}{'client CPU ms':>15}"
    )
    for protocol in protocols:
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
    print(
        "secure / plain, per round (paired back to back), over "
        f"{args.rounds} rounds: median, its 95 % confidence interval, the quartiles and the "
        f"range of the rounds; goal <= x{GOAL:.2f}"
    )
    for protocol in protocols:
        for what, ratios in (
            ("time per submit (plain rate / secure rate)", slowdown[protocol]),
            ("daemon CPU per submit", cpu_ratio[protocol]),
        ):
            low, mid, high = quartiles(ratios)
            ci_low, ci_high = median_interval(ratios)
            results[f"{protocol} {what}"] = {
                "median": mid,
                "median_ci95_low": ci_low,
                "median_ci95_high": ci_high,
                "lower_quartile": low,
                "upper_quartile": high,
                "min": min(ratios),
                "max": max(ratios),
            }
            print(
                f"  {protocol} {what}: x{mid:.3f}, 95 % CI [x{ci_low:.3f}, x{ci_high:.3f}], "
                f"quartiles [x{low:.3f}, x{high:.3f}], range x{min(ratios):.2f}..x"
                f"{max(ratios):.2f}: {verdict(ci_low, ci_high, GOAL)}"
            )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
