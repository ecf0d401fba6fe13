"""Logs from containers: a per-job collector that reads each learner container's output
streams through the engine's logs API and ships them to the training data service.

On the docker backend a learner's stdout and stderr are its container's. The engine keeps
them (json-file driver) with a nanosecond timestamp per line, so the platform side can
read them without the job directory: `container.logs(stream=True, follow=True,
timestamps=True, since=...)`, once for stdout and once for stderr.

Exactly once, in order, across restarts of this collector, reusing the learner collector
(learner/controller/collector.py) whole: numbering, batching, idempotent record ids
(job, learner, stream, seq), the offsets file committed only after the TDS acknowledged,
and the verified position with its CountStored check and rewind. Only where lines come
from differs: `ContainerLogTailer` stands in for the file tailer, and its offset is the
engine position `{"ts": <ns since epoch>, "n": <lines read at that ns>}` instead of a byte
offset. Resuming from a position reopens the stream `since` that second (the API's
granularity) and skips every line before the timestamp and the first `n` lines at it,
so a restarted or rewound collector cuts and numbers the same lines again.

A rank's containers are found by label (job and rank), oldest generation/restart first:
a container restarted in place (`docker restart`) keeps its log and is read on from the
position; a new container for the rank (the next generation) follows the old one, its
lines numbered on from the last. A follow stream ends when its container stops; the
reader then lists the rank's containers again.

It lives beside the collector it reuses (services/ and learner/ meet only in contract/):
the docker backend would start it by module name, as it starts learner controllers, and
knows the containers by the labels in `contract.containers`.

Run per job as a process: `python -m learner.controller.container_logs --job-id J
--state-dir D --tds HOST:PORT [--docker-host URL]`, the job's TDS token in
`RHIZOME_TDS_TOKEN` (never argv). It collects every rank that has a container labelled
with the job, as they appear; SIGTERM drains (ships what the engine holds) and exits,
SIGKILL loses nothing: the next run resumes from `D/learners/<rank>/collector.offsets.json`.
"""

from __future__ import annotations

import argparse
import calendar
import fcntl
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
from docker.errors import DockerException, NotFound
from requests.exceptions import RequestException

from contract import procs
from contract.containers import (
    COLLECTOR_LOCK_FILE,
    LABEL_GENERATION,
    LABEL_JOB,
    LABEL_RANK,
    LABEL_RESTART,
    label_filter,
)
from learner.controller.collector import (
    SOURCES_STREAMS,
    TOKEN_ENV,
    Collector,
    CollectorError,
)
from learner.controller.tds_channel import tls_from_environ

log = logging.getLogger(__name__)

_ENGINE_ERRORS = (DockerException, RequestException, OSError)
START = {"ts": 0, "n": 0}


class LogStreamError(ValueError):
    """A position or an engine line that cannot be understood."""


def parse_timestamp(ts: str) -> int:
    """The engine's RFC 3339 UTC timestamp (`2026-11-23T13:11:48.123456789Z`; trailing
    zeros of the fraction are dropped) as nanoseconds since the epoch."""
    if not ts.endswith("Z"):
        raise LogStreamError(f"engine timestamp {ts!r} is not UTC (no trailing Z)")
    whole, _, frac = ts[:-1].partition(".")
    try:
        secs = calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S"))
        nanos = int((frac + "000000000")[:9]) if frac else 0
    except ValueError as exc:
        raise LogStreamError(f"engine timestamp {ts!r} is not RFC 3339: {exc}") from None
    return secs * 1_000_000_000 + nanos


def split_line(raw: bytes) -> tuple[int, str]:
    """`<timestamp> <text>` as the engine sends it with timestamps=True."""
    ts, sep, text = raw.partition(b" ")
    if not sep:
        raise LogStreamError(f"engine log line without a timestamp: {raw[:80]!r}")
    return parse_timestamp(ts.decode("ascii", "replace")), text.decode("utf-8", "replace")


def check_position(raw: Any) -> dict[str, int]:
    """A position read back from the offsets file."""
    if not isinstance(raw, dict):
        raise TypeError(f"a container log position is {{'ts': ns, 'n': count}}, not {raw!r}")
    ts, n = int(raw["ts"]), int(raw["n"])
    if ts < 0 or n < 0:
        raise ValueError(f"a container log position cannot be negative: {raw!r}")
    return {"ts": ts, "n": n}


def _order(c: Any) -> tuple[int, int, str]:
    labels = c.labels or {}
    return (
        int(labels.get(LABEL_GENERATION, 0) or 0),
        int(labels.get(LABEL_RESTART, 0) or 0),
        str(c.attrs.get("Created", "")),
    )


class RankError(CollectorError):
    """One rank of the job cannot be collected."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


class ContainerLogTailer:
    """One output stream (stdout or stderr) of one rank's containers, as lines.

    A reader thread follows the engine and queues `(epoch, ts, n, text)`; `read_lines`
    takes from the queue and moves `offset` to the last line it returned. `seek` bumps the
    epoch (queued lines of the old one are dropped) and makes the reader start over from
    the new position.
    """

    def __init__(
        self,
        client: docker.DockerClient,
        job_id: str,
        rank: int,
        stream: str,
        *,
        poll_interval_s: float = 0.2,
        settle_timeout_s: float = 10.0,
    ) -> None:
        if stream not in ("stdout", "stderr"):
            raise CollectorError(f"a container has stdout and stderr, not {stream!r}")
        self.client, self.job_id, self.rank, self.stream = client, job_id, rank, stream
        self.poll_interval_s = poll_interval_s
        self.settle_timeout_s = settle_timeout_s
        self.offset: dict[str, int] = dict(START)
        self.times_us: list[int] = []  # the engine's times of the lines read_lines returned
        self._q: queue.Queue[tuple[int, int, int, str]] = queue.Queue()
        self._lock = threading.Lock()
        self._epoch = 0
        self._from: dict[str, int] = dict(START)  # where the reader (re)starts
        self._open: Any = None  # the follow stream in progress, closed to interrupt it
        self._wake = threading.Event()
        # Rounds of the reader (list the rank's containers, read each): the number of the
        # last one begun, and of the last one that found the rank's last container stopped
        # and read to its end. A drain waits for a round begun after it asked.
        self._rounds = threading.Condition(self._lock)
        self._round_begun = 0
        self._round_caught_up = -1
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._reader_running = False
        self._cut: Any = None  # the last stream closed under the reader (its tail is partial)
        # Draining: the reader stops following and, once a whole round has read what the
        # engine held, stops, so a drain ends even while a container keeps printing.
        self._draining = False
        self._drained = False
        self.errors = 0

    # -- the collector's side ---------------------------------------------------------
    def seek(self, offset: Any) -> None:
        pos = check_position(offset)
        with self._lock:
            self.offset = pos
            self._epoch += 1
            self._from = dict(pos)
            self._drained = False  # a rewind after a drain: read the rewound part again
            self._interrupt()

    def read_lines(self, max_lines: int, final: bool = False) -> list[str]:
        self._ensure_reader()
        if final and not self._draining:
            with self._lock:
                self._draining = True
                self._interrupt()  # a follow stream would never end while the container runs
        if final and self._q.empty() and not self._drained:
            # Give the reader the time to reach the end of what the engine holds now,
            # containers created since the last round included.
            with self._rounds:
                target = self._round_begun + 1
                self._wake.set()
                self._rounds.wait_for(
                    lambda: self._round_caught_up >= target, self.settle_timeout_s
                )
        out: list[str] = []
        self.times_us = []
        while len(out) < max_lines:
            try:
                epoch, ts, n, text = self._q.get_nowait()
            except queue.Empty:
                break
            if epoch != self._epoch:
                continue  # read before a seek: the reader is reading it again
            out.append(text)
            self.times_us.append(ts // 1000)
            self.offset = {"ts": ts, "n": n}
        return out

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            self._interrupt()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)

    # -- the reader -------------------------------------------------------------------
    def _ensure_reader(self) -> None:
        with self._lock:
            if self._reader_running or self._closed.is_set():
                return
            self._reader_running = True
            self._thread = threading.Thread(
                target=self._run, name=f"logs-{self.job_id}-{self.rank}-{self.stream}", daemon=True
            )
            self._thread.start()

    def _interrupt(self) -> None:
        if self._open is not None:
            self._cut = self._open
            try:
                self._open.close()
            except Exception:  # closing a stream the engine already ended
                pass
            self._open = None
        self._wake.set()

    def _containers(self) -> list[Any]:
        found = self.client.containers.list(all=True, filters=label_filter(self.job_id, self.rank))
        return sorted(found, key=_order)

    def _run(self) -> None:
        while True:
            with self._lock:
                # Decided under the lock, so that a seek either sees the reader running or
                # starts a new one (_ensure_reader).
                if self._closed.is_set() or self._drained:
                    self._reader_running = False
                    return
            self._wake.clear()
            try:
                self._read_round()
            except _ENGINE_ERRORS as exc:
                # The engine restarting, or a container removed mid-read: list again.
                self.errors += 1
                log.warning(
                    "job %s rank %s %s: reading logs: %s", self.job_id, self.rank, self.stream, exc
                )
            except Exception:  # the reader must outlive any one bad read
                self.errors += 1
                log.exception(
                    "job %s rank %s %s: reading logs", self.job_id, self.rank, self.stream
                )
            self._wake.wait(self.poll_interval_s)

    def _read_round(self) -> None:
        with self._lock:
            epoch, pos = self._epoch, dict(self._from)
            self._round_begun += 1
            round_no = self._round_begun
            draining = self._draining
        containers = self._containers()
        if not containers:
            self._caught_up(round_no, draining)
            return
        for i, c in enumerate(containers):
            last = i == len(containers) - 1
            follow = last and not draining and c.status in ("running", "restarting", "created")
            # The first `skip` lines at the resume timestamp were read before.
            resume_ts, skip = pos["ts"], pos["n"]
            for ts, text in self._lines(c, resume_ts, follow, epoch):
                if ts < resume_ts:
                    continue
                if ts == resume_ts and skip > 0:
                    skip -= 1
                    continue
                if ts == pos["ts"]:
                    pos["n"] += 1
                else:
                    pos = {"ts": ts, "n": 1}
                # Queued and remembered together: a round cut short (engine error, a
                # drain closing the follow stream) resumes after this line, not before it.
                with self._lock:
                    if epoch != self._epoch:
                        return
                    self._q.put((epoch, pos["ts"], pos["n"], text))
                    self._from = dict(pos)
            if epoch != self._epoch or self._closed.is_set():
                return
        try:
            containers[-1].reload()
            stopped = containers[-1].status not in ("running", "restarting")
        except NotFound:
            stopped = True
        if (stopped or draining) and epoch == self._epoch:  # a seek since: start over
            self._caught_up(round_no, draining)

    def _caught_up(self, round_no: int, draining: bool) -> None:
        with self._rounds:
            self._round_caught_up = max(self._round_caught_up, round_no)
            # A whole round read without following after the drain began: that is all.
            self._drained = self._drained or draining
            self._rounds.notify_all()

    def _lines(self, c: Any, since_ns: int, follow: bool, epoch: int) -> Iterator[tuple[int, str]]:
        """The container's lines at or after `since_ns`'s second, in the engine's order.

        The API's `since` is in whole seconds: the caller drops what lies before the
        position's timestamp and skips by count at it.
        """
        is_out = self.stream == "stdout"
        # The SDK refuses since=0 (it wants a positive time): from the start, no `since`.
        since = {"since": since_ns // 1_000_000_000} if since_ns >= 1_000_000_000 else {}
        with self._lock:
            if epoch != self._epoch or self._closed.is_set():
                return
            stream = c.logs(
                stdout=is_out,
                stderr=not is_out,
                stream=True,
                follow=follow,
                timestamps=True,
                **since,
            )
            self._open = stream
        buf = b""
        try:
            for chunk in stream:
                buf += chunk
                *whole, buf = buf.split(b"\n")
                for raw in whole:
                    line = self._parsed(raw)
                    if line is not None:
                        yield line
            if buf and epoch == self._epoch and self._cut is not stream:
                # The container's last output had no newline; the engine holds no more.
                line = self._parsed(buf)
                if line is not None:
                    yield line
        except Exception:
            # A stream closed under us by a seek or close raises whatever the transport
            # raises then; only a failure of a stream still wanted is one.
            if epoch == self._epoch and not self._closed.is_set() and self._cut is not stream:
                raise
        finally:
            with self._lock:
                if self._open is stream:
                    self._open = None
            try:
                stream.close()
            except Exception:  # already closed by a seek or the engine
                pass

    def _parsed(self, raw: bytes) -> tuple[int, str] | None:
        try:
            return split_line(raw)
        except LogStreamError as exc:
            # Skipped, not retried: reading it again would give the same bad line.
            self.errors += 1
            log.error("job %s rank %s %s: %s", self.job_id, self.rank, self.stream, exc)
            return None


class ContainerLogCollector(Collector):
    """The learner collector with the engine's output streams as its source (see module)."""

    def __init__(
        self,
        client: docker.DockerClient,
        job_id: str,
        learner: int,
        state_dir: str | Path,
        tds_address: str,
        **kwargs: Any,
    ) -> None:
        self.client = client
        self._tailer_poll_s = float(kwargs.pop("engine_poll_s", 0.2))
        # The metric sources that read a stream get its lines here; those reading files
        # stay with the controller inside the container (it runs as the learner, so a
        # link the job put in its directory is never followed with the platform's rights).
        kwargs.setdefault("source_kinds", SOURCES_STREAMS)
        metric_sources = kwargs.pop("metric_sources", None)
        super().__init__(job_id, learner, state_dir, tds_address, metric_sources, **kwargs)

    def open_tailer(self, stream: str) -> ContainerLogTailer:
        return ContainerLogTailer(
            self.client, self.job_id, self.learner, stream, poll_interval_s=self._tailer_poll_s
        )

    def line_times_us(self, stream: str, count: int, now_us: int) -> list[int]:
        # When the container printed them (the engine's timestamp), also after a restart
        # of this collector: a resent line gets the same time as the first time.
        tailer = self.tailers[stream]
        assert isinstance(tailer, ContainerLogTailer)
        return tailer.times_us[:count]

    def offset_of(self, raw: Any) -> dict[str, int]:
        return check_position(raw)


class JobLogCollector:
    """One `ContainerLogCollector` per rank with a container labelled with the job."""

    def __init__(
        self,
        client: docker.DockerClient,
        job_id: str,
        state_dir: str | Path,
        tds_address: str,
        *,
        token: str = "",
        poll_interval_s: float = 0.5,
        **collector_kwargs: Any,
    ) -> None:
        if not job_id:
            raise CollectorError("job_id is empty")
        self.client, self.job_id, self.state_dir = client, job_id, Path(state_dir)
        self.tds_address, self.token = tds_address, token
        self.poll_interval_s = poll_interval_s
        self.collector_kwargs = collector_kwargs
        self.collectors: dict[int, ContainerLogCollector] = {}
        self.failed: dict[int, str] = {}  # rank -> why it cannot be collected
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_seen = time.monotonic()  # when the engine last listed a job's container

    def idle_s(self) -> float:
        """For how long the engine has listed no container of the job (or not answered)."""
        return time.monotonic() - self._last_seen

    def ranks(self) -> set[int]:
        found = self.client.containers.list(all=True, filters=label_filter(self.job_id))
        if found:
            self._last_seen = time.monotonic()
        out: set[int] = set()
        for c in found:
            labels = c.labels or {}
            if labels.get(LABEL_JOB) == self.job_id and str(labels.get(LABEL_RANK, "")).isdigit():
                out.add(int(labels[LABEL_RANK]))
        return out

    def discover(self) -> None:
        for rank in sorted(self.ranks() - set(self.collectors) - set(self.failed)):
            try:
                c = ContainerLogCollector(
                    self.client,
                    self.job_id,
                    rank,
                    self.state_dir,
                    self.tds_address,
                    token=self.token,
                    **self.collector_kwargs,
                )
            except CollectorError as exc:
                raise RankError(rank, f"rank {rank}: {exc}") from None
            c.start()
            self.collectors[rank] = c
            log.info("job %s: collecting the logs of rank %d", self.job_id, rank)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.discover()
            except _ENGINE_ERRORS as exc:
                log.warning("job %s: listing containers: %s", self.job_id, exc)
            except RankError as exc:
                # A rank that cannot be collected (its offsets file belongs to another job,
                # or is unreadable): say so once and keep collecting the others.
                self.failed[exc.rank] = str(exc)
                log.error("job %s: %s", self.job_id, exc)
            self._stop.wait(self.poll_interval_s)

    def start(self) -> JobLogCollector:
        self.discover()
        self._thread = threading.Thread(target=self._run, name=f"logs-{self.job_id}", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> bool:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        ok = not self.failed
        for c in self.collectors.values():
            ok = c.stop(drain=drain, timeout=timeout) and ok
        return ok


LOCK_FILE = COLLECTOR_LOCK_FILE


def hold_lock(state_dir: Path, stop: threading.Event, poll_s: float = 0.2) -> int | None:
    """Take the job's collector lock (`<state_dir>/collector.lock`, flock), waiting while an
    earlier collector of the job still holds it (a drain in progress): two collectors of
    one job would write the same offsets files. Returns the open descriptor (the lock
    lives as long as this process: the kernel drops it at exit, also after a SIGKILL), or
    None when `stop` is set before the lock is free. The file then holds our pid and start
    time, so the platform knows whom to signal."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if stop.wait(poll_s):
                os.close(fd)
                return None
    me = procs.ProcRef.of(os.getpid())
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "start": me.start if me else -1}).encode(), 0)
    return fd


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner.controller.container_logs")
    p.add_argument("--job-id", required=True)
    p.add_argument("--state-dir", required=True, help="where the per-rank offsets files live")
    p.add_argument("--tds", required=True, help="host:port of the training data service")
    p.add_argument("--docker-host", default=None, help="engine URL (default: DOCKER_HOST)")
    p.add_argument("--flush-interval-s", type=float, default=0.2)
    p.add_argument("--verify-interval-s", type=float, default=5.0)
    p.add_argument("--drain-timeout-s", type=float, default=60.0)
    p.add_argument(
        "--once",
        action="store_true",
        help="ship what the engine holds now, then exit (a drain; the platform runs it before "
        "it removes a job's containers when no collector runs)",
    )
    p.add_argument(
        "--idle-exit-s",
        type=float,
        default=60.0,
        help="drain and exit once the engine has listed no container of the job for this "
        "long (0: never); the platform starts a collector again when the job runs again",
    )
    p.add_argument(
        "--metric-sources",
        default=None,
        help="the manifest's evaluation_metrics as JSON: those reading stdout/stderr are fed here",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s logs %(levelname)s %(message)s")
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        metric_sources = json.loads(args.metric_sources) if args.metric_sources else None
        lock = hold_lock(Path(args.state_dir), done)
    except (OSError, ValueError) as exc:
        print(f"logs: {exc}", file=sys.stderr)
        return 2
    if lock is None:
        return 0  # told to stop while an earlier collector of the job still ran
    try:
        client = (
            docker.DockerClient(base_url=args.docker_host)
            if args.docker_host
            else docker.from_env()
        )
        client.ping()
    except _ENGINE_ERRORS as exc:
        print(
            f"logs: cannot reach the Docker engine ({exc}); set --docker-host or DOCKER_HOST",
            file=sys.stderr,
        )
        return 2
    try:
        job = JobLogCollector(
            client,
            args.job_id,
            args.state_dir,
            args.tds,
            token=os.environ.get(TOKEN_ENV, ""),
            tls=tls_from_environ(),  # mutual TLS to the TDS on a TLS platform
            flush_interval_s=args.flush_interval_s,
            verify_interval_s=args.verify_interval_s,
            drain_timeout_s=args.drain_timeout_s,
            metric_sources=metric_sources,
        ).start()
    except (CollectorError, ValueError, *_ENGINE_ERRORS) as exc:
        print(f"logs: {exc}", file=sys.stderr)
        return 2
    if args.once:
        return 0 if job.stop(drain=True) else 1
    print(f"logs collector running for {args.job_id}", flush=True)
    while not done.wait(1.0):
        if args.idle_exit_s > 0 and job.idle_s() > args.idle_exit_s:
            # The job's containers are gone (or the engine is): nothing left to follow. An
            # orphan must not outlive its job; the guardian starts one again if needed.
            log.info("job %s: no container for %.0f s; exiting", args.job_id, job.idle_s())
            break
    return 0 if job.stop(drain=True) else 1


if __name__ == "__main__":
    sys.exit(main())
