"""Logs from containers (learner/controller/container_logs.py) on the real engine, into the
real Elasticsearch-API server through the TDS: numbered lines printed by containers of the
offline learner image must be searchable exactly once, in order, across a SIGKILL of the
collector and a restart of the learner container."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import docker
import pytest

from contract.containers import LABEL_GENERATION, LABEL_JOB, LABEL_RANK
from learner.controller.collector import OFFSETS_FILE, TOKEN_ENV
from learner.controller.container_logs import (
    ContainerLogCollector,
    JobLogCollector,
    parse_timestamp,
)
from services.embedded.docker_engine import DockerEngine
from services.tds.api import Query
from services.tds.es_store import ElasticsearchStore
from services.tds.memory_store import MemoryStore
from tests.docker.conftest import LearnerImage
from tests.learner.controller.test_collector_verify import _forget
from tests.services.tds.helpers import REPO, tds_in_process


@pytest.fixture
def job_id(docker_client: docker.DockerClient) -> Iterator[str]:
    job = f"logs{uuid.uuid4().hex[:8]}"
    yield job
    for c in docker_client.containers.list(all=True, filters={"label": f"{LABEL_JOB}={job}"}):
        c.remove(force=True)


@pytest.fixture
def es_store(es_server: Any) -> Iterator[ElasticsearchStore]:
    store = ElasticsearchStore(es_server.url, prefix=f"cl{uuid.uuid4().hex[:6]}")
    yield store
    store.close()


@pytest.fixture
def tds(es_store: ElasticsearchStore) -> Iterator[str]:
    with tds_in_process(es_store) as (addr, _):
        yield addr


def _learner(
    client: docker.DockerClient,
    image: LearnerImage,
    job: str,
    script: str,
    rank: int = 0,
    generation: int = 0,
) -> Any:
    """A container labelled as the docker backend labels a learner, running `sh -c script`."""
    return client.containers.run(
        image.tag,
        ["sh", "-c", script],
        detach=True,
        network_mode="none",
        labels={LABEL_JOB: job, LABEL_RANK: str(rank), LABEL_GENERATION: str(generation)},
    )


def _stored(store: ElasticsearchStore, job: str, stream: str = "stdout") -> list[tuple[int, str]]:
    store.refresh(job)
    return [(ln.seq, ln.line) for ln in store.query_logs(Query(job)) if ln.stream == stream]


def _wait(cond: Callable[[], bool], what: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _said_running(proc: subprocess.Popen[str]) -> threading.Event:
    """Set once the collector `proc` (its stdout piped) prints that it runs; the thread
    that waits for it drains that stdout to the end."""
    said = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "logs collector running" in line:
                said.set()

    threading.Thread(target=read, daemon=True).start()
    return said


def _open_gate(container: Any) -> None:
    """Let a script that paces its output until /tmp/go exists print the rest at once;
    one that has ended already (a slow machine) needs nothing."""
    with contextlib.suppress(docker.errors.APIError):
        container.exec_run(["touch", "/tmp/go"])


def _exited(container: Any) -> bool:
    container.reload()
    return bool(container.status == "exited")


def test_engine_timestamps_parse_to_nanoseconds() -> None:
    assert parse_timestamp("1970-01-01T00:00:01.5Z") == 1_500_000_000
    assert parse_timestamp("1970-01-01T00:00:02.000000007Z") == 2_000_000_007
    assert parse_timestamp("1970-01-01T00:00:03Z") == 3_000_000_000


def test_a_container_printing_n_lines_gives_exactly_n_searchable_lines_in_order(
    docker_client: docker.DockerClient,
    learner_image: LearnerImage,
    job_id: str,
    es_store: ElasticsearchStore,
    tds: str,
    tmp_path: Path,
) -> None:
    n = 500
    c = _learner(
        docker_client,
        learner_image,
        job_id,
        f"for i in $(seq 0 {n - 1}); do echo line $i; done; echo oops >&2; printf tail",
    )
    collector = JobLogCollector(docker_client, job_id, tmp_path, tds, token="job-token").start()
    _wait(lambda: _exited(c), "the container to exit")
    assert collector.stop(drain=True)
    expected = [f"line {i}" for i in range(n)] + ["tail"]
    assert _stored(es_store, job_id) == list(enumerate(expected))
    assert _stored(es_store, job_id, "stderr") == [(0, "oops")]
    # Each line carries the time the engine stamped it with, not when it was read.
    printed = c.logs(stdout=True, stderr=False, timestamps=True).splitlines()
    engine_us = [parse_timestamp(raw.split(b" ", 1)[0].decode()) // 1000 for raw in printed]
    stored_us = [
        ln.time.seconds * 1_000_000 + ln.time.nanos // 1000
        for ln in es_store.query_logs(Query(job_id))
        if ln.stream == "stdout"
    ]
    assert stored_us == engine_us
    hits = [ln.line for ln in es_store.query_logs(Query(job_id, search="499"))]
    assert hits == ["line 499"]


def test_the_collector_killed_mid_stream_and_restarted_loses_and_duplicates_nothing(
    docker_engine: DockerEngine,
    docker_client: docker.DockerClient,
    learner_image: LearnerImage,
    job_id: str,
    es_store: ElasticsearchStore,
    tds: str,
    tmp_path: Path,
) -> None:
    n = 3000
    # Slow enough that the collector is killed while the container still prints, and
    # never past half way before the test opens the gate (/tmp/go) once the second
    # collector runs: then the rest comes at once (the fixed pace took 15 s).
    c = _learner(
        docker_client,
        learner_image,
        job_id,
        f"for i in $(seq 0 {n - 1}); do echo line $i; "
        f"if [ $i -eq {n // 2 - 1} ]; then until [ -e /tmp/go ]; do sleep 0.1; done; fi; "
        "if [ $((i % 100)) -eq 99 ] && [ ! -e /tmp/go ]; then sleep 0.5; fi; done",
    )
    env = dict(os.environ, DOCKER_HOST=docker_engine.url, **{TOKEN_ENV: "job-token"})
    argv = [
        sys.executable,
        "-m",
        "learner.controller.container_logs",
        "--job-id",
        job_id,
        "--state-dir",
        str(tmp_path),
        "--tds",
        tds,
        "--verify-interval-s",
        "0.5",
    ]
    offsets = tmp_path / "learners" / "0" / OFFSETS_FILE
    first = subprocess.Popen(argv, cwd=REPO, env=env)
    try:
        # Killed once it stored lines and committed their offsets (at most every 2 s: on
        # a loaded machine 300 lines were stored before the first commit, and the
        # `offsets.exists()` below failed).
        _wait(
            lambda: len(_stored(es_store, job_id)) >= 300 and offsets.exists(),
            "the first lines to be stored and their offsets committed",
        )
        assert not _exited(c), "the container finished before the collector was killed"
    finally:
        os.kill(first.pid, signal.SIGKILL)
        first.wait(30)
    assert offsets.exists()
    second = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    try:
        # The rest comes once the second collector follows the container (it says so):
        # SIGTERMed before it runs at all, it would die of it, not drain.
        running = _said_running(second)
        _wait(
            lambda: running.is_set() or second.poll() is not None,
            "the second collector to follow the container",
        )
        _open_gate(c)
        _wait(lambda: _exited(c), "the container to exit", timeout=180)
        second.send_signal(signal.SIGTERM)  # drains what the engine holds, then exits
        assert second.wait(120) == 0
    finally:
        if second.poll() is None:
            os.kill(second.pid, signal.SIGKILL)
            second.wait(30)
    assert _stored(es_store, job_id) == [(i, f"line {i}") for i in range(n)]


def test_a_restarted_learner_container_and_the_next_generation_follow_on(
    docker_client: docker.DockerClient,
    learner_image: LearnerImage,
    job_id: str,
    es_store: ElasticsearchStore,
    tds: str,
    tmp_path: Path,
) -> None:
    # The container's own filesystem survives a restart: the second run prints b-lines.
    script = (
        "if [ -e /tmp/ran ]; then p=b; else p=a; touch /tmp/ran; fi; "
        "for i in $(seq 0 9); do echo $p$i; done"
    )
    c = _learner(docker_client, learner_image, job_id, script)
    collector = JobLogCollector(docker_client, job_id, tmp_path, tds).start()
    _wait(lambda: len(_stored(es_store, job_id)) == 10, "the first run's lines")
    _wait(lambda: _exited(c), "the container to exit")
    c.restart()
    _wait(lambda: len(_stored(es_store, job_id)) == 20, "the restarted container's lines")
    _wait(lambda: _exited(c), "the restarted container to exit")
    nxt = _learner(
        docker_client, learner_image, job_id, "for i in $(seq 0 9); do echo c$i; done", generation=1
    )
    _wait(lambda: _exited(nxt), "the next generation to exit")
    assert collector.stop(drain=True)
    expected = [f"{p}{i}" for p in "abc" for i in range(10)]
    assert _stored(es_store, job_id) == list(enumerate(expected))


def _run_module(*args: str, docker_host: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "learner.controller.container_logs", *args],
        cwd=REPO,
        env=dict(os.environ, DOCKER_HOST=docker_host),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_an_unreadable_offsets_file_is_refused_naming_the_file(
    docker_engine: DockerEngine,
    docker_client: docker.DockerClient,
    learner_image: LearnerImage,
    job_id: str,
    tmp_path: Path,
) -> None:
    c = _learner(docker_client, learner_image, job_id, "echo hi")
    _wait(lambda: _exited(c), "the container to exit")
    offsets = tmp_path / "learners" / "0" / OFFSETS_FILE
    offsets.parent.mkdir(parents=True)
    # A byte offset where a container position belongs: not this collector's file.
    offsets.write_text(
        json.dumps({"job_id": job_id, "learner": 0, "streams": {"stdout": {"offset": 7, "seq": 0}}})
    )
    args = ("--job-id", job_id, "--state-dir", str(tmp_path), "--tds", "127.0.0.1:1")
    done = _run_module(*args, docker_host=docker_engine.url)
    assert done.returncode == 2
    assert str(offsets) in done.stderr and "unreadable" in done.stderr
    assert "Traceback" not in done.stderr


def test_an_engine_that_does_not_answer_is_a_clear_error(tmp_path: Path) -> None:
    args = ("--job-id", "j", "--state-dir", str(tmp_path), "--tds", "127.0.0.1:1")
    done = _run_module(*args, docker_host=f"unix://{tmp_path}/no-engine.sock")
    assert done.returncode == 2
    assert "cannot reach the Docker engine" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_drain_ends_while_a_container_keeps_printing_and_leaves_no_gap(
    docker_client: docker.DockerClient,
    learner_image: LearnerImage,
    job_id: str,
    es_store: ElasticsearchStore,
    tds: str,
    tmp_path: Path,
) -> None:
    c = _learner(
        docker_client,
        learner_image,
        job_id,
        "i=0; while true; do echo line $i; i=$((i+1)); sleep 0.01; done",
    )
    collector = JobLogCollector(docker_client, job_id, tmp_path, tds).start()
    _wait(lambda: len(_stored(es_store, job_id)) >= 100, "the first lines to be stored")
    result: list[bool] = []
    stopper = threading.Thread(target=lambda: result.append(collector.stop(drain=True)))
    stopper.start()
    stopper.join(120)
    assert not stopper.is_alive(), "the drain followed the running container for ever"
    assert result == [True]
    assert not _exited(c), "the container stopped: the drain was not tested against output"
    stored = _stored(es_store, job_id)
    assert len(stored) >= 100
    assert stored == [(i, f"line {i}") for i in range(len(stored))]


def test_lines_the_store_lost_after_its_ack_are_read_from_the_engine_again(
    docker_client: docker.DockerClient,
    learner_image: LearnerImage,
    job_id: str,
    tmp_path: Path,
) -> None:
    # The in-memory store stands in for a search server losing acknowledged writes (as in
    # tests/learner/controller/test_collector_verify.py); the engine is the real one.
    store = MemoryStore()
    c = _learner(docker_client, learner_image, job_id, "for i in $(seq 0 49); do echo l$i; done")
    _wait(lambda: _exited(c), "the container to exit")
    with tds_in_process(store) as (addr, _):
        collector = ContainerLogCollector(docker_client, job_id, 0, tmp_path, addr)
        collector.verify_interval_s = 3600  # only the check before exiting
        collector.start()
        _wait(lambda: len(_memory_stored(store, job_id)) == 50, "the lines to be stored")
        _forget(store, job_id, range(10, 30))  # acknowledged, then lost
        assert collector.stop(drain=True)
    assert collector.rewinds == 1
    assert _memory_stored(store, job_id) == [(i, f"l{i}") for i in range(50)]


def _memory_stored(store: MemoryStore, job: str) -> list[tuple[int, str]]:
    return [(ln.seq, ln.line) for ln in store.query_logs(Query(job)) if ln.stream == "stdout"]
