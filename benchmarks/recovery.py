"""Time from SIGKILL of each lifecycle component to it serving again (FfDL Table 3), with
a cold restart of the daemon and with a hot standby (`rhizomed --standby`), in one run.

The daemon hosts api, scheduler and lcm. For each mode, REPS times, while a long job runs:
- api:       SIGKILL the active daemon; served again = the Trainer answers GetJob to a
             client of the platform (restart: the one address; standby: `--api A,B`, so
             the time includes the client moving on to the standby);
- scheduler: the same kill; served again = a live daemon holds the daemon leader key
             (the scheduler's loop starts as it takes it);
- lcm:       the same kill; served again = a new live LCM holds the LCM leader key and
             has re-adopted the job's guardian;
- guardian:  SIGKILL the job's guardian; served again = a new live guardian holds the
             job's guardian key (the same in both modes: the LCM restarts it);
- learner:   SIGKILL a learner controller; served again = a new live controller holds
             the rank's status key.
Restart mode: this script, acting as supervisor, starts the daemon again at once.
Standby mode: a standby waits warm; after the kill it takes over, and this script then
starts the killed one again as the next standby (as a supervisor would), and waits until
it is warm before the next repetition.

Goal (issue #18): every component serves again < 0.3 s after a SIGKILL of the active
daemon with a standby. FfDL: API 3–5 s, LCM 4–6 s, guardian 1–2 s, learner 10–20 s.

    .venv/bin/python benchmarks/recovery.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable

from _platform import BenchPlatform

from contract import etcd_keys, procs
from contract.etcd import EtcdClient
from services.client.sdk import Client, ClientError
from services.embedded.platform import DaemonServer
from services.embedded.standby import StandbyDaemonServer
from services.store.jobs import JobsRepository
from services.store.mongo import connect, database_name

SERVICES = "api,scheduler,lcm"
COMPONENTS = ("api", "scheduler", "lcm", "guardian", "learner")
# A kill of the daemon leaves guardians and learners running (they are re-adopted): their
# rows time their own kills, which the standby does not change.
GOAL = {"api": "< 0.3 s", "scheduler": "< 0.3 s", "lcm": "< 0.3 s", "guardian": "–", "learner": "–"}
FFDL = {"api": "3–5 s", "scheduler": "–", "lcm": "4–6 s", "guardian": "1–2 s", "learner": "10–20 s"}
MANIFEST = "name: recovery\nmemory: 256MiB\nframework:\n  command: 'sleep 100000'\n"


def until(probe: Callable[[], bool], timeout_s: float = 60) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if probe():
            return time.perf_counter() - start
        time.sleep(0.005)
    raise SystemExit("component did not come back within 60 s")


def moved_on(etcd: EtcdClient, key: str, old: int) -> Callable[[], bool]:
    """A probe: `key` is held by a process other than `old` (a successor took over)."""
    return lambda: holder(etcd, key) not in (0, old)


def holder(etcd: EtcdClient, key: str) -> int:
    entry = etcd.get(key)
    if entry is None or not isinstance(entry.value, dict):
        return 0
    value = entry.value
    return int(value["pid"]) if procs.ref_alive(value.get("pid"), value.get("start")) else 0


def kill(server: DaemonServer) -> None:
    assert server.pid is not None and server.proc is not None
    os.kill(server.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)


def run(standby: bool, reps: int) -> dict[str, list[float]]:
    results: dict[str, list[float]] = {k: [] for k in COMPONENTS}
    with BenchPlatform(services=SERVICES) as platform:
        etcd = EtcdClient.connect(platform.etcd.url)
        repo = JobsRepository(connect(platform.mongo.url))
        args = list(platform.daemon_argv_args())
        daemons: list[DaemonServer] = [platform.daemon]  # type: ignore[list-item]
        if standby:
            warm = StandbyDaemonServer(
                platform.data_dir,
                procs.free_port(),
                procs.free_port(),
                args,
                environ=platform.daemon_environ(),
            )
            warm.start_timeout_s = 60
            warm.start()
            daemons.append(warm)
        address = ",".join(d.url for d in daemons)
        client = Client(address, token=platform.token, timeout_s=2, tls=False, failover_s=60)
        job_id = client.create_job(MANIFEST).job_id
        until(lambda: repo.get(job_id).status == "PROCESSING")
        guardian_key = etcd_keys.guardian_lease(job_id)
        learner_key = etcd_keys.learner_status(job_id, 0)
        lcm_key = etcd_keys.leader("lcm")
        daemon_key = etcd_keys.leader(f"daemon/{database_name(platform.mongo.url)}/lcm+scheduler")

        def api_serves() -> bool:
            try:
                client.get_job(job_id)
                return True
            except ClientError:
                return False

        for _ in range(reps):
            old_lcm, old_daemon = holder(etcd, lcm_key), holder(etcd, daemon_key)
            active = next(d for d in daemons if d.pid == old_daemon)
            killed = time.perf_counter()
            kill(active)
            restarting = None
            if not standby:
                # As the supervisor does: start it and go on. start_daemon() returns only
                # once the daemon is healthy as a whole (the REST gateway too), which comes
                # after its gRPC API serves and it leads.
                restarting = threading.Thread(target=platform.start_daemon)
                restarting.start()
            until(api_serves)
            results["api"].append(time.perf_counter() - killed)
            until(moved_on(etcd, daemon_key, old_daemon))
            results["scheduler"].append(time.perf_counter() - killed)
            until(moved_on(etcd, lcm_key, old_lcm))
            results["lcm"].append(time.perf_counter() - killed)
            if restarting is not None:
                restarting.join()
                daemons = [platform.daemon]  # type: ignore[list-item]
            if standby:  # the supervisor starts the killed daemon again, as the next standby
                again = StandbyDaemonServer(
                    platform.data_dir,
                    active.port,
                    active.rest_port,
                    args,
                    environ=platform.daemon_environ(),
                )
                again.start_timeout_s = 60
                again.start()
                daemons = [d for d in daemons if d is not active] + [again]

            old = holder(etcd, guardian_key)
            os.kill(old, signal.SIGKILL)
            results["guardian"].append(until(moved_on(etcd, guardian_key, old)))
            old = holder(etcd, learner_key)
            os.kill(old, signal.SIGKILL)
            results["learner"].append(until(moved_on(etcd, learner_key, old)))
            time.sleep(0.5)
        client.delete_job(job_id)
        until(lambda: repo.get(job_id).status == "DELETED")
        client.close()
        etcd.close()
        for daemon in daemons:
            daemon.stop(timeout_s=30)
        platform.daemon = None  # stopped above (the platform's own may be long dead)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    cold = run(standby=False, reps=args.reps)
    hot = run(standby=True, reps=args.reps)
    print(f"# recovery: SIGKILL -> serving again, {args.reps} repetitions per mode, one run")
    print(
        "| component | restart (median, s) | min–max | standby (median, s) | min–max "
        "| standby / restart | goal (standby) | FfDL |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in COMPONENTS:
        c, h = cold[name], hot[name]
        mc, mh = statistics.median(c), statistics.median(h)
        print(
            f"| {name} | {mc:.3f} | {min(c):.3f}–{max(c):.3f} | {mh:.3f} | {min(h):.3f}–{max(h):.3f} "
            f"| {mh / mc:.2f}x | {GOAL[name]} | {FFDL[name]} |"
        )
    print("| helper | no process on the local backend | – | – | – | – | – | 3–4 s |")


if __name__ == "__main__":
    main()
