"""Time from SIGKILL of each lifecycle component to it serving again (FfDL Table 3).

For each component, REPS times, while a long job runs:
- api:      SIGKILL the daemon; a supervisor (this script) starts it again at once;
            served again = the Trainer answers GetJob.
- lcm:      the same kill (the LCM lives in the daemon); served again = the new LCM
            holds the leader key and has re-adopted the job's live guardian.
- guardian: SIGKILL the job's guardian; served again = a new live guardian holds the
            job's guardian key.
- learner:  SIGKILL a learner controller; served again = a new live controller holds the
            rank's status key (it re-adopts the still-running command).
The helper has no process on the local backend (each controller ships its own logs).

Goal: under 1 s for every platform service and the guardian.
FfDL: API 3–5 s, LCM 4–6 s, guardian 1–2 s, helper 3–4 s, learner 10–20 s.

    .venv/bin/python benchmarks/recovery.py [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from collections.abc import Callable

from _platform import BenchPlatform

from contract import etcd_keys, procs
from contract.etcd import EtcdClient
from services.client.sdk import Client, ClientError
from services.store.jobs import JobsRepository
from services.store.mongo import connect

FFDL = {"api": "3–5 s", "lcm": "4–6 s", "guardian": "1–2 s", "learner": "10–20 s"}
MANIFEST = "name: recovery\nmemory: 256MiB\nframework:\n  command: 'sleep 100000'\n"


def until(probe: Callable[[], bool], timeout_s: float = 60) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if probe():
            return time.perf_counter() - start
        time.sleep(0.01)
    raise SystemExit("component did not come back within 60 s")


def holder(etcd: EtcdClient, key: str) -> int:
    entry = etcd.get(key)
    if entry is None or not isinstance(entry.value, dict):
        return 0
    value = entry.value
    return int(value["pid"]) if procs.ref_alive(value.get("pid"), value.get("start")) else 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {k: [] for k in ("api", "lcm", "guardian", "learner")}
    with BenchPlatform() as platform:
        etcd = EtcdClient.connect(platform.etcd.url)
        repo = JobsRepository(connect(platform.mongo.url))
        client = Client(platform.api, token=platform.token, timeout_s=2)
        job_id = client.create_job(MANIFEST).job_id
        until(lambda: repo.get(job_id).status == "PROCESSING")
        guardian_key = etcd_keys.guardian_lease(job_id)
        learner_key = etcd_keys.learner_status(job_id, 0)
        leader_key = etcd_keys.leader("lcm")

        def api_serves() -> bool:
            try:
                client.get_job(job_id)
                return True
            except ClientError:
                return False

        for _ in range(args.reps):
            old_leader = holder(etcd, leader_key)
            killed = time.perf_counter()
            platform.kill_daemon()
            platform.start_daemon()
            until(api_serves)
            results["api"].append(time.perf_counter() - killed)
            until(lambda o=old_leader: holder(etcd, leader_key) not in (0, o))
            results["lcm"].append(time.perf_counter() - killed)

            old = holder(etcd, guardian_key)
            os.kill(old, signal.SIGKILL)
            results["guardian"].append(
                until(lambda o=old: holder(etcd, guardian_key) not in (0, o))
            )

            old = holder(etcd, learner_key)
            os.kill(old, signal.SIGKILL)
            results["learner"].append(until(lambda o=old: holder(etcd, learner_key) not in (0, o)))
            time.sleep(0.5)
        client.delete_job(job_id)
        until(lambda: repo.get(job_id).status == "DELETED")
        client.close()
        etcd.close()
    print("| component | Rhizome (median, s) | min–max (s) | goal | FfDL |")
    print("| --- | --- | --- | --- | --- |")
    for name, values in results.items():
        goal = "< 1 s" if name != "learner" else "–"
        print(
            f"| {name} | {statistics.median(values):.2f} | {min(values):.2f}–{max(values):.2f} "
            f"| {goal} | {FFDL[name]} |"
        )
    print("| helper | no process on the local backend | – | < 1 s | 3–4 s |")


if __name__ == "__main__":
    main()
