"""What etcd's bcrypt cost does to a platform that adds and removes a user per job.

Every job's etcd user added or removed (the LCM does both for every job,
contract/etcd.py `add_job_user` / `remove_job_user`) raises etcd's auth revision, and etcd
then refuses every client's token once ("revision of auth store is old"); each client
authenticates again, which costs etcd one bcrypt check of its password, and etcd answers
an authentication only once no auth change was applied while it checked
(contract/etcd.py `_authenticate`). So the cost of a password check is paid by every
client for every job that starts or ends.

Each round starts a real etcd with authentication on, at one bcrypt cost: `--clients`
client threads (each its own authenticated client, as learners and guardians are) put and
get keys while one thread adds and removes job users `--changes` times. It reports, per
cost: auth changes per second, client calls per second, client call p50/p99, the clients'
re-authentications and how long an authentication took (p50 / max), and etcd's CPU
seconds. Costs alternate over `--rounds` rounds (ABBA), so both see the same load.

    .venv/bin/python benchmarks/etcd_auth_churn.py [--rounds 4] [--clients 8] [--changes 40]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from _platform import ROOT  # noqa: F401  (puts the repository on sys.path)

from contract import etcd_keys
from contract.etcd import EtcdClient, EtcdCredentials
from contract.etcd_server import ETCD_BCRYPT_COST, etcd_argv
from contract.etcd_users import add_job_user, enable_auth, remove_job_user
from services.embedded.servers import EtcdServer

DEFAULT_COST = 10  # etcd's own default


class CostedEtcd(EtcdServer):
    """The embedded etcd, at a given bcrypt cost."""

    def __init__(self, data_dir: Path, cost: int) -> None:
        super().__init__(data_dir)
        self.cost = cost

    def argv(self) -> list[str]:
        return etcd_argv(
            self.data_dir / "etcd-data", self.port, self.peer_port, bcrypt_cost=self.cost
        )


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_round(cost: int, clients: int, changes: int) -> dict[str, float]:
    root = EtcdCredentials("root", "root-" + os.urandom(8).hex())
    platform = EtcdCredentials("rhizome", "platform-" + os.urandom(8).hex())
    with tempfile.TemporaryDirectory(prefix="etcd-churn-") as tmp:
        server = CostedEtcd(Path(tmp), cost)
        server.start()
        try:
            enable_auth(server.url, root, platform, etcd_keys.ROOT + "/")
            pid = server.pid
            assert pid is not None
            stop = threading.Event()
            latencies: list[float] = []
            auth_times: list[float] = []
            errors: list[str] = []
            lock = threading.Lock()
            made: list[EtcdClient] = []

            def client_loop(n: int) -> None:
                client = EtcdClient.connect(server.url, credentials=platform)
                made.append(client)
                plain = client._authenticate

                def timed() -> None:
                    t = time.perf_counter()
                    try:
                        plain()
                    finally:
                        with lock:
                            auth_times.append(time.perf_counter() - t)

                client._authenticate = timed  # type: ignore[method-assign]
                key = etcd_keys.control(f"churn-{n}")
                i = 0
                while not stop.is_set():
                    t = time.perf_counter()
                    try:
                        client.put(key, {"n": i})
                        client.get(key)
                    except Exception as exc:  # counted and shown: a refused call is a result
                        with lock:
                            errors.append(
                                f"{type(exc).__name__}: "
                                + " ".join(repr(exc.__cause__).split())[:300]
                            )
                        continue
                    with lock:
                        latencies.append(time.perf_counter() - t)
                    i += 1

            threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(clients)]
            for th in threads:
                th.start()
            time.sleep(1.0)  # every client connected and calling
            with lock:
                latencies.clear()
                auth_times.clear()
            cpu0, t0 = cpu_seconds(pid), time.perf_counter()
            for c in range(changes):
                add_job_user(server.url, root, f"job-churn-{c}")
                remove_job_user(server.url, root, f"job-churn-{c}")
            wall = time.perf_counter() - t0
            cpu = cpu_seconds(pid) - cpu0
            stop.set()
            for th in threads:
                th.join()
            for client in made:
                client.close()
        finally:
            server.stop()
    lat = sorted(latencies)
    auths = sorted(auth_times) or [0.0]
    return {
        "cost": cost,
        "changes_per_s": changes / wall,
        "calls_per_s": len(lat) / wall,
        "call_p50_ms": 1e3 * lat[len(lat) // 2] if lat else float("nan"),
        "call_p99_ms": 1e3 * lat[int(len(lat) * 0.99)] if lat else float("nan"),
        "reauth_per_change": len(auth_times) / changes,
        "auth_p50_ms": 1e3 * auths[len(auths) // 2],
        "auth_max_ms": 1e3 * auths[-1],
        "etcd_cpu_s": cpu,
        "errors": len(errors),
        "first_error": errors[0] if errors else "",  # type: ignore[dict-item]
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=4, help="rounds, costs alternating ABBA")
    parser.add_argument("--clients", type=int, default=8, help="authenticated client threads")
    parser.add_argument("--changes", type=int, default=40, help="job users added and removed")
    args = parser.parse_args()
    costs = [DEFAULT_COST, ETCD_BCRYPT_COST]
    runs: dict[int, list[dict[str, float]]] = {c: [] for c in costs}
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    for r in range(args.rounds):
        order = costs if r % 4 in (0, 3) else costs[::-1]
        for cost in order:
            result = one_round(cost, args.clients, args.changes)
            runs[cost].append(result)
            print(
                f"round {r + 1} cost {cost:>2}: {result['changes_per_s']:.1f} changes/s, "
                f"{result['calls_per_s']:.0f} calls/s, call p99 {result['call_p99_ms']:.0f} ms, "
                f"{result['reauth_per_change']:.1f} re-auths/change, auth p50 "
                f"{result['auth_p50_ms']:.0f} ms max {result['auth_max_ms']:.0f} ms, "
                f"etcd CPU {result['etcd_cpu_s']:.2f} s, errors {result['errors']:.0f} "
                f"{result['first_error']}",
                flush=True,
            )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")

    def med(cost: int, key: str) -> float:
        return statistics.median(float(x[key]) for x in runs[cost])

    print(f"\nmedians over {args.rounds} rounds, {args.clients} clients, {args.changes} changes:")
    print("| bcrypt cost | changes/s | client calls/s | call p99 ms | auth p50 ms | auth max ms "
          "| etcd CPU s | errors |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for cost in costs:
        print(
            f"| {cost} | {med(cost, 'changes_per_s'):.1f} | {med(cost, 'calls_per_s'):.0f} | "
            f"{med(cost, 'call_p99_ms'):.0f} | {med(cost, 'auth_p50_ms'):.1f} | "
            f"{med(cost, 'auth_max_ms'):.0f} | {med(cost, 'etcd_cpu_s'):.2f} | "
            f"{sum(x['errors'] for x in runs[cost]):.0f} |"
        )
    low, high = ETCD_BCRYPT_COST, DEFAULT_COST
    print(
        f"cost {low} vs {high}, same run: auth changes/s x{med(low, 'changes_per_s') / med(high, 'changes_per_s'):.2f}, "
        f"client calls/s x{med(low, 'calls_per_s') / med(high, 'calls_per_s'):.2f}, "
        f"auth p50 x{med(low, 'auth_p50_ms') / max(med(high, 'auth_p50_ms'), 1e-9):.3f}, "
        f"etcd CPU per change x{(med(low, 'etcd_cpu_s')) / max(med(high, 'etcd_cpu_s'), 1e-9):.2f}"
    )


if __name__ == "__main__":
    main()
