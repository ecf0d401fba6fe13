"""The steady window of benchmarks/control_plane_scale.py: when it opens (`--settle-s`
after the last PROCESSING), the rates it prints (per alive job per second, the simulated
learners' threads apart, each half apart) and where a thread's CPU is read from. No
platform: synthetic samples and /proc-shaped files."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # its own imports: _load, _platform
    try:
        spec = importlib.util.spec_from_file_location(
            "control_plane_scale_bench", BENCHMARKS / "control_plane_scale.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


def test_the_window_opens_settle_s_after_the_last_processing(bench: ModuleType) -> None:
    clock = [0.0]
    taken: list[float] = []

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    def take() -> dict[str, Any]:
        taken.append(clock[0])
        return {"at": clock[0]}

    samples = bench.steady_window(take, settle_s=30.0, steady_s=20.0, sleep=sleep)
    # nothing sampled before the settle time is over: the window is 30..50 s, halved
    assert taken == [30.0, 40.0, 50.0]
    assert [s["at"] for s in samples] == taken


def test_no_settle_opens_the_window_at_once(bench: ModuleType) -> None:
    clock = [0.0]

    def sleep(seconds: float) -> None:
        clock[0] += seconds

    samples = bench.steady_window(lambda: {"at": clock[0]}, 0.0, 10.0, sleep=sleep)
    assert [s["at"] for s in samples] == [0.0, 5.0, 10.0]


def sample(at: float, daemon: float, guardian: float, sim: dict[Any, float]) -> dict[str, Any]:
    return {"at": at, "daemon_cpu": daemon, "guardian_cpu": guardian, "sim_threads": sim}


def test_steady_rates_are_per_alive_job_per_second_with_the_learners_apart(
    bench: ModuleType,
) -> None:
    # 100 jobs, 20 s: the daemon used 0.4 s, the guardian processes 3.0 s of which their
    # simulated learners' threads 2.0 s (one of them new in the window: counted whole)
    s0 = sample(10.0, 5.0, 7.0, {(1, 11): 1.0, (1, 12): 0.5})
    s1 = sample(30.0, 5.4, 10.0, {(1, 11): 2.5, (1, 12): 0.5, (1, 13): 0.5})
    rates = bench.steady_rates(s0, s1, 100)
    assert rates["daemon"] == pytest.approx(0.2)  # 0.4 s / 100 jobs / 20 s = 0.2 ms
    assert rates["sim"] == pytest.approx(1.0)
    assert rates["guardian"] == pytest.approx(0.5)  # (3.0 - 2.0) s: the hosts' own


def test_etcd_s_cpu_and_keep_alives_per_alive_job_per_second(bench: ModuleType) -> None:
    """From etcd's /metrics: its process CPU and the messages of its LeaseKeepAlive
    streams (not the streams, not other methods' messages); NaN where a sample has no
    etcd figures (its /metrics could not be read)."""
    text = "\n".join(
        [
            "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds.",
            "process_cpu_seconds_total 12.5",
            'grpc_server_msg_received_total{grpc_method="LeaseKeepAlive",'
            'grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 4000',
            'grpc_server_msg_received_total{grpc_method="Range",'
            'grpc_service="etcdserverpb.KV",grpc_type="unary"} 900',
            'grpc_server_started_total{grpc_method="LeaseKeepAlive",'
            'grpc_service="etcdserverpb.Lease",grpc_type="bidi_stream"} 101',
        ]
    )
    assert bench.parse_etcd_load(text) == {"etcd_cpu": 12.5, "etcd_keepalives": 4000.0}
    s0 = {**sample(10.0, 5.0, 7.0, {}), "etcd_cpu": 12.5, "etcd_keepalives": 4000.0}
    s1 = {**sample(30.0, 5.0, 7.0, {}), "etcd_cpu": 13.3, "etcd_keepalives": 12000.0}
    rates = bench.steady_rates(s0, s1, 100)
    assert rates["etcd"] == pytest.approx(0.4)  # 0.8 s / 100 jobs / 20 s
    assert rates["keepalives"] == pytest.approx(4.0)  # 8,000 / 100 jobs / 20 s
    no_etcd = bench.steady_rates(sample(10.0, 5.0, 7.0, {}), s1, 100)
    assert math.isnan(no_etcd["etcd"]) and math.isnan(no_etcd["keepalives"])


def test_the_mongodb_servers_cpu_per_alive_job_per_second(bench: ModuleType) -> None:
    s0 = {**sample(10.0, 5.0, 7.0, {}), "mongo_cpu": 40.0}
    s1 = {**sample(30.0, 5.0, 7.0, {}), "mongo_cpu": 42.0}
    assert bench.steady_rates(s0, s1, 100)["mongo"] == pytest.approx(1.0)  # 2 s/100/20 s
    assert math.isnan(bench.steady_rates(sample(10.0, 5.0, 7.0, {}), s1, 100)["mongo"])


class Statuses:
    """A jobs collection whose jobs move on by a list of statuses per read."""

    def __init__(self, steps: dict[str, list[str]]) -> None:
        self.steps = steps
        self.reads = 0

    def find(self, query: dict[str, Any], projection: dict[str, int]) -> list[dict[str, Any]]:
        self.reads += 1
        return [
            {"_id": j, "status": self.steps[j][min(self.reads, len(self.steps[j])) - 1]}
            for j in query["_id"]["$in"]
        ]


def test_wait_all_reads_every_pending_status_at_once_and_counts_the_failed(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "POLL_S", 0.0)
    jobs = Statuses(
        {
            "a": ["PENDING", "PROCESSING"],
            "b": ["PENDING", "DEPLOYING", "PROCESSING"],
            "c": ["FAILED"],
        }
    )
    assert bench.wait_all(jobs, ["a", "b", "c"], "PROCESSING", 60) == ["c"]
    assert jobs.reads == 3  # one read a poll, not one a job
    late = Statuses({"d": ["PENDING"]})
    assert bench.wait_all(late, ["d"], "PROCESSING", 0) == ["d"]


def test_a_thread_s_cpu_is_the_schedulers_count_not_the_ticks(
    bench: ModuleType, tmp_path: Path
) -> None:
    task = tmp_path / "123"
    task.mkdir()
    # comm with a space and a parenthesis, as /proc writes it; utime 10, stime 5 ticks
    fields = ["S"] + ["0"] * 10 + ["10", "5"] + ["0"] * 30
    (task / "stat").write_text("123 (rz (sim) x) " + " ".join(fields) + "\n")
    (task / "schedstat").write_text("1210000000 5000 42\n")
    assert bench.thread_cpu(task) == pytest.approx(1.21)
    (task / "schedstat").unlink()  # a kernel without it: the ticks
    tick = os.sysconf("SC_CLK_TCK")
    assert bench.thread_cpu(task) == pytest.approx(15 / tick)


def test_sim_thread_cpu_reads_only_the_simulated_learners_threads(bench: ModuleType) -> None:
    stop = threading.Event()
    ready = threading.Event()
    named: list[int] = []

    def learner() -> None:
        # what the benchmark's sitecustomize does to a simulated learner's thread
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(bench.SIM_THREAD)
        named.append(threading.get_native_id())
        ready.set()
        stop.wait()

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    try:
        assert ready.wait(10)
        found = bench.sim_thread_cpu(os.getpid())
        assert set(found) == set(named)
        assert all(cpu >= 0 for cpu in found.values())
    finally:
        stop.set()
        thread.join()
