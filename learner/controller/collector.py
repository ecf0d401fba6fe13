"""The log and metric collector of one learner: files in, TDS batches out, nothing lost.

The learner controller runs the user command with stdout and stderr redirected to
`<job_dir>/learners/<rank>/stdout.log` and `stderr.log`. The collector tails those files
and the learner's metric sources (`evaluation_metrics`), and ships them to the training
data service in batches, flushed when `batch_lines` lines wait or `flush_interval_s`
(`FLUSH_INTERVAL_S`, 0.5 s) has passed since the oldest one was read. Each batch costs a
TDS request, a bulk request to the search server and an fsync of the offsets file, on
the cores the learner uses: a learner printing a line a step (10 steps/s) cost five
batches a second at 0.2 s, two at 0.5 s, and a line is still searchable well within 2 s
of its print (the flush, the RPC and bulk, the search server's 250 ms refresh).

Waiting costs nothing while the learner is quiet (issue #16: on a 2-core machine every
wake-up of the platform is taken from a pinned worker): the stream files' directory is
watched with inotify (file_wait.py), so the collector sleeps until a line is written;
once a batch is open it sleeps until the batch is due, unless it holds a burst
(`BURST_LINES`): then it reads on as lines are written and ships the batch when it is full
or as soon as the learner pauses (`BURST_PAUSE_S` without a write); an acknowledgement wakes it to commit the offsets; a store check wakes
it when due; and, as a safety net, it looks every `IDLE_SAFETY_S`. Where inotify is not
available, or for streams that are not files (a container's, container_logs.py) or
metric sources reading files of their own, it polls every `poll_interval_s` as before.

Batches are pipelined: while one is on its way (the TDS building its bulk request, the
search server indexing it), the collector reads and sends the next, up to
`max_in_flight` unacknowledged batches (3). A search server indexes one bulk while the
next is parsed, and is never idle waiting for a round trip (issue #18: one learner's
lines at >= 0.9x of the server's raw bulk ceiling). Offsets are still committed in
order: a batch's position only once it and every batch before it are acknowledged.
Each learner's collector has at most `max_in_flight` requests at the TDS, which is what
keeps many learners sharing it fairly.

Exactly once, in order, across crashes of the collector, the TDS or Elasticsearch:
- every line gets a per-(learner, stream) sequence number, every sample a per-source
  one; the TDS stores them under deterministic document ids, so a re-sent batch
  overwrites itself;
- `collector.offsets.json` beside the logs holds, per stream, the byte offset and next
  seq just past an *acknowledged* batch, and every metric source's state; it is written
  atomically (temp file, fsync, rename) only after the TDS acknowledged both the lines
  and the samples. A restarted collector re-reads from there: it cuts the same lines
  (see `tail.py`) and numbers them the same, so whatever the TDS already had is
  overwritten with identical documents and nothing is skipped. Because a resent line
  costs nothing but the resending, the acknowledged position is written at most every
  `commit_interval_s` (`OFFSETS_COMMIT_S`, 2 s) while lines keep coming, and at once by
  a drain, a store check and a stop: its write and fsync were a fifth of a shipping
  learner's collector CPU at two batches a second (issue #16), and a crash now resends
  at most 2 s more;
- while the TDS is unreachable the collector retries with exponential backoff
  (tenacity), holding its place; the learner keeps writing to its files meanwhile;
- an acknowledgement is not taken on trust for ever: a search server can lose writes it
  acknowledged (the embedded noida-db drops bulk writes that race its shutdown; a real
  cluster can lose an unreplicated shard). The offsets file also holds a *verified*
  position. Every `verify_interval_s`, and before the collector exits after a drain, it
  asks the TDS (`CountStored`) how many records it holds between the verified and the
  acknowledged position; if any are missing it rewinds to the verified position and
  sends everything from there again (idempotent, as above), then checks again. Only a
  complete count moves the verified position forward.

Two ways to run it:
- in the controller: `c = Collector(job_id, rank, job_dir, tds_address,
  metric_sources=manifest.get("evaluation_metrics")); c.start()` and, once the user
  command has exited, `c.stop(drain=True)` before the learner's final status is
  recorded (so that follow streams, which end with the job, see the last lines);
- as a process: `python -m learner.controller.collector --job-id J --learner 0
  --job-dir D --tds 127.0.0.1:PORT` (SIGTERM drains and exits, SIGINT exits at once).

This module talks to the platform only through the TDS RPCs (learner/ never imports
services/).
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import grpc
import tenacity
from rhizome.v1 import tds_pb2

from contract.containers import COLLECTOR_TOKEN_ENV
from contract.credentials import (
    tds_tls_file,
)
from contract.env import learner_dir
from contract.logs import COMMAND_STREAMS
from learner.controller.file_wait import FileWait
from learner.controller.metric_sources import MetricSource, Sample, create_sources
from learner.controller.metric_sources.tail import LineTailer
from learner.controller.tds_channel import RenewingStub, retryable, tls_from_environ

log = logging.getLogger(__name__)

STREAMS = COMMAND_STREAMS  # the files the command writes (contract.logs)
# While lines keep arriving, the store check waits for a quiet moment, at most this many
# verify intervals (30 s by default): it stops the pipeline for a count on the server.
BUSY_VERIFY_FACTOR = 6
FLUSH_INTERVAL_S = 0.5  # the longest a line read waits for its batch (module docstring)
# A batch of at least this many lines is a burst: it is read as it is written and shipped
# when the learner pauses this long (its tail does not wait for the flush interval).
BURST_LINES = 100
BURST_PAUSE_S = 0.02
# With inotify, the longest sleep with nothing written (a safety net behind the wake-ups).
IDLE_SAFETY_S = 1.0
# The acknowledged position is written to the offsets file at most this often while lines
# keep coming (module docstring: a crash resends at most this much, overwriting).
OFFSETS_COMMIT_S = 2.0
# A collector's deadline for one write (AddLogLines, AddMetrics): longer than the TDS takes
# to answer one at worst, a wait for a write slot (services/tds/servicer.py
# MAX_WRITE_WAIT_S, 30 s, then RESOURCE_EXHAUSTED, nothing written) plus the bulk request
# (services/tds/es_store.py REQUEST_TIMEOUT_S, 60 s). A shorter deadline made a collector
# send a batch again while the search server was still writing the first copy, doubling
# the work of a server that was already behind (issue #18).
WRITE_TIMEOUT_S = 120.0
OFFSETS_FILE = "collector.offsets.json"


class CollectorError(RuntimeError):
    """The collector cannot go on (bad configuration, unreadable offsets file)."""


class Stopped(Exception):
    """Raised inside a retry loop when the collector was told to stop without draining."""


def write_json_atomically(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# Which metric sources a collector feeds: all of them, only those reading one of the
# command's streams (they need the lines: the collector shipping the streams feeds them),
# or only those reading their own files (the learner side, when the platform ships the
# streams).
SOURCES_ALL, SOURCES_STREAMS, SOURCES_FILES = "all", "streams", "files"
SOURCE_KINDS = (SOURCES_ALL, SOURCES_STREAMS, SOURCES_FILES)

# As a process, the collector takes its job token from this variable (LearnerSpec.tds_token).
TOKEN_ENV = COLLECTOR_TOKEN_ENV


class Tailer(Protocol):
    """Where a stream's lines come from: a file (`LineTailer`) here, a container's output
    stream on the docker backend (learner/controller/container_logs.py). `offset` is any
    JSON value that says where reading stands; the collector commits and restores it."""

    offset: Any

    def seek(self, offset: Any) -> None: ...

    def read_lines(self, max_lines: int, final: bool = False) -> list[str]: ...

    def close(self) -> None: ...


class Collector:
    def __init__(
        self,
        job_id: str,
        learner: int,
        job_dir: str | Path,
        tds_address: str,
        metric_sources: Any = None,
        *,
        batch_lines: int = 5000,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        poll_interval_s: float = 0.05,
        rpc_timeout_s: float = 30.0,
        write_timeout_s: float = WRITE_TIMEOUT_S,
        max_backoff_s: float = 2.0,
        drain_timeout_s: float = 60.0,
        verify_interval_s: float = 5.0,
        max_rewinds: int = 3,
        max_in_flight: int = 3,
        commit_interval_s: float = OFFSETS_COMMIT_S,
        token: str = "",
        tls: Mapping[str, str] | None = None,
        clock_us: Callable[[], int] = lambda: time.time_ns() // 1000,
        streams: Sequence[str] = STREAMS,
        source_kinds: str = SOURCES_ALL,
    ) -> None:
        if not job_id:
            raise CollectorError("job_id is empty")
        if learner < 0:
            raise CollectorError(f"learner rank {learner} must be >= 0")
        self.job_id = job_id
        self.learner = learner
        self.dir = learner_dir(job_dir, learner)
        self.tds_address = tds_address
        self.batch_lines = batch_lines
        self.flush_interval_s = flush_interval_s
        self.poll_interval_s = poll_interval_s
        self.rpc_timeout_s = rpc_timeout_s
        self.write_timeout_s = write_timeout_s
        self.max_backoff_s = max_backoff_s
        self.drain_timeout_s = drain_timeout_s
        self.verify_interval_s = verify_interval_s
        self.max_rewinds = max_rewinds
        if max_in_flight < 1:
            raise CollectorError(f"max_in_flight is {max_in_flight}; it must be >= 1")
        self.max_in_flight = max_in_flight
        self.commit_interval_s = commit_interval_s
        # The latest acknowledged position not yet in the offsets file, and when the file
        # was last written (`_commit`).
        self._acked: dict[str, Any] | None = None
        self._committed_at = -float("inf")
        self.commits = 0  # offsets file writes so far (tests)
        # Sent, not yet acknowledged, oldest first: (calls, offsets snapshot, lines, samples);
        # each call is (its future, how to send it again).
        self._in_flight: collections.deque[
            tuple[list[tuple[Any, Callable[[], Any]]], dict[str, Any], int, int]
        ] = collections.deque()
        self.clock_us = clock_us
        # Which of the command's streams this collector ships: both, or none when another
        # process ships them (a container's streams, read by the platform's collector).
        self.streams: tuple[str, ...] = tuple(streams)
        unknown = sorted(set(self.streams) - set(STREAMS))
        if unknown:
            raise CollectorError(f"unknown streams {unknown}; a command has {list(STREAMS)}")
        if source_kinds not in SOURCE_KINDS:
            raise CollectorError(f"source_kinds is {source_kinds!r}; use one of {SOURCE_KINDS}")
        # Every source is created (ids are positional: `regex_extractor.1` must name the
        # same source on both sides), then only the kind this collector feeds is kept.
        self.sources: list[MetricSource] = [
            src
            for src in create_sources(metric_sources, self.dir)
            if source_kinds == SOURCES_ALL
            or (src.stream is not None) == (source_kinds == SOURCES_STREAMS)
        ]
        self.tailers: dict[str, Tailer] = {s: self.open_tailer(s) for s in self.streams}
        self.next_seq = dict.fromkeys(self.streams, 0)
        self.metric_seq = {src.source_id: 0 for src in self.sources}
        self.pending_lines: list[tds_pb2.LogLine] = []
        self.pending_samples: list[tds_pb2.MetricSample] = []
        self._oldest_pending: float | None = None
        self._budget = batch_lines  # how many records the last `collect` could read
        self._burst_over = False  # a burst's batch whose learner paused: ship it now
        self._waiter: FileWait | None = None  # while `run` waits on inotify
        self._last_us = 0
        self._stop = threading.Event()
        self._drain = True
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.sent_lines = 0
        self.sent_samples = 0
        self.rewinds = 0  # times the store was found short and the collector resent
        self._failed_checks = 0  # consecutive short counts of the same window
        self._can_verify = True  # False against a TDS without CountStored
        self._last_verify = time.monotonic()
        # The job token (LearnerSpec.tds_token) goes on every call: the TDS's internal port
        # refuses calls without a credential, and confines this one to its own job.
        # With `tls` (LearnerSpec.tds_tls) the channel is mutual TLS: the internal port of a
        # TLS platform admits only certificates of its CA.
        # A job's certificate is short-lived: the guardian writes the next one to
        # `tds-tls.json` beside the logs (or where the backend mounts it: `tds_tls_file`),
        # and every call (retries included) goes through a channel opened with the newest
        # (`RenewingStub`).
        self._stub = RenewingStub(tds_address, token, tls, tds_tls_file(self.dir))
        self._verified: dict[str, Any] = {}
        self._load_offsets()
        if not self._verified:
            self._verified = self._position()

    # -- where lines come from (a subclass reads another source, same numbering) -------
    def open_tailer(self, stream: str) -> Tailer:
        return LineTailer(self.dir / f"{stream}.log")

    def line_times_us(self, stream: str, count: int, now_us: int) -> list[int]:
        """The times of the `count` lines just read from `stream`: a file has none of its
        own, so they are when they were read."""
        return [now_us] * count

    def offset_of(self, raw: Any) -> Any:
        """An offset read back from the offsets file, checked (ValueError/TypeError if bad)."""
        return int(raw)

    # -- durable position -------------------------------------------------------------
    @property
    def offsets_path(self) -> Path:
        return self.dir / OFFSETS_FILE

    def _load_offsets(self) -> None:
        try:
            raw = self.offsets_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        try:
            st = json.loads(raw)
            if st.get("job_id") != self.job_id or st.get("learner") != self.learner:
                raise CollectorError(
                    f"{self.offsets_path} belongs to job {st.get('job_id')!r} learner "
                    f"{st.get('learner')!r}, not {self.job_id!r} learner {self.learner}; "
                    "remove it or use the right job directory"
                )
            for s in self.streams:
                pos = st["streams"].get(s, {})
                self.tailers[s].seek(self.offset_of(pos.get("offset", 0)))
                self.next_seq[s] = int(pos.get("seq", 0))
            for src in self.sources:
                src.restore(st.get("sources", {}).get(src.source_id, {}))
                self.metric_seq[src.source_id] = int(st.get("metric_seq", {}).get(src.source_id, 0))
            # Files written before verification existed have no verified position: their
            # acknowledged one is the best there is.
            verified = st.get("verified")
            self._verified = self._checked_position(verified) if verified else self._position()
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CollectorError(
                f"{self.offsets_path} is unreadable ({exc}); it is written atomically, so "
                "this is not a crash artefact: inspect it, or remove it to resend everything"
            ) from exc

    def _position(self) -> dict[str, Any]:
        """Where reading stands: what a restarted or rewound collector resumes from."""
        return {
            "streams": {
                s: {"offset": self.tailers[s].offset, "seq": self.next_seq[s]} for s in self.streams
            },
            "sources": {src.source_id: src.state() for src in self.sources},
            "metric_seq": dict(self.metric_seq),
        }

    def _checked_position(self, pos: Any) -> dict[str, Any]:
        """A position read from the offsets file, with every field this collector needs."""
        return {
            "streams": {
                s: {
                    "offset": self.offset_of(pos["streams"][s]["offset"]),
                    "seq": int(pos["streams"][s]["seq"]),
                }
                for s in self.streams
            },
            "sources": {
                src.source_id: dict(pos.get("sources", {}).get(src.source_id, {}))
                for src in self.sources
            },
            "metric_seq": {
                src.source_id: int(pos.get("metric_seq", {}).get(src.source_id, 0))
                for src in self.sources
            },
        }

    def _snapshot(self) -> dict[str, Any]:
        return {
            "version": 2,
            "job_id": self.job_id,
            "learner": self.learner,
            **self._position(),
            "verified": self._verified,
        }

    def _rewind(self, pos: dict[str, Any]) -> None:
        for s in self.streams:
            self.tailers[s].seek(self.offset_of(pos["streams"][s]["offset"]))
            self.next_seq[s] = int(pos["streams"][s]["seq"])
        for src in self.sources:
            src.restore(pos["sources"].get(src.source_id, {}))
            self.metric_seq[src.source_id] = int(pos["metric_seq"].get(src.source_id, 0))
        self.pending_lines, self.pending_samples = [], []
        self._oldest_pending = None
        self._burst_over = False

    # -- reading ----------------------------------------------------------------------
    def _now_us(self) -> int:
        # Never backwards: the TDS orders a learner's lines by time first.
        self._last_us = max(self.clock_us(), self._last_us)
        return self._last_us

    def _add_samples(self, src: MetricSource, samples: Sequence[Sample], now_us: int) -> None:
        for smp in samples:
            seq = self.metric_seq[src.source_id]
            self.metric_seq[src.source_id] = seq + 1
            msg = tds_pb2.MetricSample(
                job_id=self.job_id,
                learner=self.learner,
                seq=seq,
                name=smp.name,
                value=smp.value,
                step=smp.step,
                source=src.source_id,
            )
            t = smp.time_us if smp.time_us is not None else now_us
            msg.time.seconds, msg.time.nanos = t // 1_000_000, (t % 1_000_000) * 1000
            self.pending_samples.append(msg)

    def collect(self, final: bool = False) -> int:
        """Read what is new into the pending batch; return how many records were read."""
        budget = self._budget = max(self.batch_lines - len(self.pending_lines), 1)
        now_us = self._now_us()
        n = 0
        for stream in self.streams:
            texts = self.tailers[stream].read_lines(budget, final)
            if not texts and not final:
                continue
            seq = self.next_seq[stream]
            times = self.line_times_us(stream, len(texts), now_us)
            for text, t in zip(texts, times, strict=True):
                msg = tds_pb2.LogLine(
                    job_id=self.job_id, learner=self.learner, stream=stream, seq=seq, line=text
                )
                msg.time.seconds, msg.time.nanos = t // 1_000_000, (t % 1_000_000) * 1000
                self.pending_lines.append(msg)
                seq += 1
            self.next_seq[stream] = seq
            n += len(texts)
            for src in self.sources:
                if src.stream == stream:
                    self._add_samples(src, src.feed(texts, final), now_us)
        for src in self.sources:
            if src.stream is None:
                got = src.poll(final, budget)
                self._add_samples(src, got, now_us)
                n += len(got)
        if (self.pending_lines or self.pending_samples) and self._oldest_pending is None:
            self._oldest_pending = time.monotonic()
        return n

    # -- shipping ---------------------------------------------------------------------
    def _call(self, fn: Callable[[], Any]) -> Any:
        def give_up_on_stop(_: tenacity.RetryCallState) -> bool:
            if self._stop.is_set() and not self._drain:
                return True
            return self._deadline is not None and time.monotonic() > self._deadline

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(retryable),
            wait=tenacity.wait_exponential(multiplier=0.05, max=self.max_backoff_s),
            stop=give_up_on_stop,
            before_sleep=lambda rs: log.warning(
                "TDS at %s unavailable (%s); retrying",
                self.tds_address,
                rs.outcome.exception() if rs.outcome else "?",
            ),
            reraise=True,
        )
        return retrying(fn)

    def flush(self) -> None:
        """Send the pending batch and wait until it and every batch before it are
        acknowledged, committing the offsets."""
        self.send()
        self._settle(everything=True)
        self._commit(force=True)

    def _write_offsets(self, snapshot: dict[str, Any]) -> None:
        write_json_atomically(self.offsets_path, snapshot)
        self.commits += 1
        self._committed_at = time.monotonic()
        self._acked = None  # whatever was acknowledged before is in it, or superseded

    def _commit(self, force: bool = False) -> None:
        """Write the latest acknowledged position, if any, when `commit_interval_s` has
        passed since the last write (or `force`)."""
        if self._acked is None:
            return
        if force or time.monotonic() - self._committed_at >= self.commit_interval_s:
            self._write_offsets(self._acked)

    def _commit_due(self) -> float | None:
        """Seconds until the acknowledged position is due in the file (None: nothing)."""
        if self._acked is None:
            return None
        return max(0.0, self._committed_at + self.commit_interval_s - time.monotonic())

    def send(self) -> None:
        """Send the pending batch without waiting for it; then wait only while more than
        `max_in_flight` batches are unacknowledged."""
        if self.pending_lines or self.pending_samples:
            snapshot = self._snapshot()
            lines, samples = self.pending_lines, self.pending_samples
            requests: list[tuple[Any, Any]] = [
                (self._stub.AddLogLines, tds_pb2.AddLogLinesRequest(lines=lines[i : i + step]))
                for step in (self.batch_lines,)
                for i in range(0, len(lines), step)
            ] + [
                (self._stub.AddMetrics, tds_pb2.AddMetricsRequest(samples=samples[i : i + step]))
                for step in (self.batch_lines,)
                for i in range(0, len(samples), step)
            ]
            calls: list[tuple[Any, Callable[[], Any]]] = [
                (
                    method.future(req, timeout=self.write_timeout_s),
                    functools.partial(method, req, timeout=self.write_timeout_s),
                )
                for method, req in requests
            ]
            for future, _again in calls:  # its answer wakes `run` to commit the offsets
                future.add_done_callback(self._answered)
            self._in_flight.append((calls, snapshot, len(lines), len(samples)))
            self.pending_lines, self.pending_samples = [], []
            self._oldest_pending = None
            self._burst_over = False
        while len(self._in_flight) > self.max_in_flight:
            self._settle_oldest()

    def _settle(self, everything: bool = False) -> None:
        """Commit the batches acknowledged so far, in order (all of them: wait for each)."""
        while self._in_flight and (
            everything or all(future.done() for future, _ in self._in_flight[0][0])
        ):
            self._settle_oldest()

    def _settle_oldest(self) -> None:
        calls, snapshot, n_lines, n_samples = self._in_flight[0]
        for future, again in calls:
            try:
                try:
                    future.result()
                except grpc.RpcError as exc:
                    if not retryable(exc):
                        raise
                    self._call(again)  # sent again, with backoff, until acknowledged
            except grpc.RpcError as exc:
                if retryable(exc):
                    raise  # stopping or past the drain deadline: keep the old offsets
                # The TDS refused the data itself; resending cannot help and must not stall
                # the learner's logs behind it.
                log.error("TDS refused a batch of %d lines, skipping it: %s", n_lines, exc)
        self._acked = snapshot  # written by `_commit`, at most every commit_interval_s
        self.sent_lines += n_lines
        self.sent_samples += n_samples
        self._in_flight.popleft()

    def verify(self) -> bool:
        """Check that the store holds every record acknowledged since the last check.

        Call it with nothing pending (right after a flush), so that the reading position is
        the acknowledged one. Returns True when the store had them all (the verified
        position moves up), False when it rewound to the verified position so that the
        missing records are sent again.
        """
        self._last_verify = time.monotonic()
        acked = self._position()
        if (
            not self._can_verify
            or self.verify_interval_s <= 0
            or self.pending_lines
            or self.pending_samples
        ):
            return True
        ver = self._verified
        log_ranges = [
            tds_pb2.SeqRange(key=s, from_seq=ver["streams"][s]["seq"], to_seq=self.next_seq[s])
            for s in self.streams
            if self.next_seq[s] > ver["streams"][s]["seq"]
        ]
        metric_ranges = [
            tds_pb2.SeqRange(key=sid, from_seq=ver["metric_seq"].get(sid, 0), to_seq=seq)
            for sid, seq in self.metric_seq.items()
            if seq > ver["metric_seq"].get(sid, 0)
        ]
        if log_ranges or metric_ranges:
            req = tds_pb2.CountStoredRequest(
                job_id=self.job_id,
                learner=self.learner,
                log_ranges=log_ranges,
                metric_ranges=metric_ranges,
            )
            try:
                resp = self._call(
                    functools.partial(self._stub.CountStored, req, timeout=self.rpc_timeout_s)
                )
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.warning("the TDS at %s cannot count records; not verifying", self.tds_address)
                self._can_verify = False
                return True
            want = [r.to_seq - r.from_seq for r in (*log_ranges, *metric_ranges)]
            have = [*resp.log_counts, *resp.metric_counts]
            if have != want:
                missing = sum(want) - sum(min(h, w) for h, w in zip(have, want, strict=False))
                self._failed_checks += 1
                if self._failed_checks <= self.max_rewinds:
                    self.rewinds += 1
                    log.warning(
                        "the TDS holds %d fewer records than it acknowledged since the last "
                        "check (%s); sending them again from the verified position",
                        missing,
                        ", ".join(f"{r.key} {r.from_seq}..{r.to_seq - 1}" for r in log_ranges)
                        or "metrics",
                    )
                    self._rewind(ver)
                    # the acknowledged position not yet written is dropped with it: a
                    # crash must resend from here too
                    self._write_offsets(self._snapshot())
                    return False
                # The same window came up short every time: the store refuses these
                # records (a refused batch is skipped, see flush). Stop resending them.
                log.error(
                    "the TDS still misses %d records after %d resends; giving up on them",
                    missing,
                    self.max_rewinds,
                )
        self._failed_checks = 0
        self._verified = acked
        self._write_offsets(self._snapshot())
        return True

    def _verify_due(self, idle: bool = True) -> bool:
        """A check is due every `verify_interval_s`, at a moment the learner is quiet
        (nothing new was read): a check stops the pipeline (everything in flight is
        settled first) and the count itself is a refresh and a search on the server, so
        under a burst it waits, for at most BUSY_VERIFY_FACTOR intervals."""
        since = time.monotonic() - self._last_verify
        return (
            self.verify_interval_s > 0
            and not self.pending_lines
            and not self.pending_samples
            and since >= self.verify_interval_s
            and (idle or since >= BUSY_VERIFY_FACTOR * self.verify_interval_s)
            and self._position() != self._verified
        )

    def _due(self) -> bool:
        if len(self.pending_lines) >= self.batch_lines or self._burst_over:
            return True
        return (
            self._oldest_pending is not None
            and time.monotonic() - self._oldest_pending >= self.flush_interval_s
        )

    # -- running ----------------------------------------------------------------------
    def _answered(self, _future: Any) -> None:
        waiter = self._waiter
        if waiter is not None:
            waiter.interrupt()

    def watched_files(self) -> list[Path] | None:
        """The files whose writes wake the collector (inotify), or None when it must
        poll: a stream that is not a file, or a metric source reading files of its own."""
        if any(src.stream is None for src in self.sources):
            return None
        if not all(isinstance(t, LineTailer) for t in self.tailers.values()):
            return None
        return [t.path for t in self.tailers.values() if isinstance(t, LineTailer)]

    def _pause(self, n: int) -> None:
        """Between two reads: see the module docstring for when the collector wakes."""
        waiter = self._waiter
        if waiter is None or waiter.broken:
            if n == 0:
                self._stop.wait(self.poll_interval_s)
            return
        if self._oldest_pending is not None:
            if n >= self._budget:
                return  # a burst: read on until the batch is full
            due = self._oldest_pending + self.flush_interval_s - time.monotonic()
            if due <= 0:
                return
            if len(self.pending_lines) >= BURST_LINES:
                # A burst: read what is written next; ship once the learner pauses.
                if not waiter.wait(min(due, BURST_PAUSE_S)):
                    self._burst_over = True
                return
            self._stop.wait(due)  # a few lines: the batch is read to its end when due
            return
        if n > 0:
            return  # just shipped what was read: there may be more
        timeout = IDLE_SAFETY_S
        if self.verify_interval_s > 0 and self._position() != self._verified:
            since = time.monotonic() - self._last_verify
            timeout = min(timeout, max(0.01, self.verify_interval_s - since))
        commit = self._commit_due()
        if commit is not None:
            timeout = min(timeout, max(0.01, commit))
        waiter.wait(timeout)

    def run(self) -> None:
        """Collect and ship until stopped; with drain, until everything is shipped."""
        self.dir.mkdir(parents=True, exist_ok=True)
        files = self.watched_files()
        self._waiter = FileWait.open(files) if files else None
        if self._stop.is_set() and self._waiter is not None:
            self._waiter.interrupt()  # stopped while opening: `stop` could not wake it
        try:
            while not self._stop.is_set():
                if self._waiter is not None:
                    self._waiter.clear()  # what is written from here on wakes the next wait
                n = self.collect()
                if self._due():
                    self.send()
                self._settle()
                self._commit()
                if self._verify_due(idle=n == 0):
                    self._settle(everything=True)  # verify counts what is acknowledged
                    self.verify()
                self._pause(n)
            if self._drain:
                while True:
                    n = self.collect(final=True)
                    self.flush()
                    # Done only once everything read is shipped and the store has it all.
                    if n == 0 and self.verify():
                        break
        except grpc.RpcError as exc:
            self.error = exc
            log.warning("collector stopped before its data was shipped: %s", exc)
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            # Stopped without a drain (or failing): what was acknowledged is kept.
            try:
                self._commit(force=True)
            except OSError as exc:
                log.warning("could not write %s: %s", self.offsets_path, exc)
            waiter, self._waiter = self._waiter, None
            if waiter is not None:
                waiter.close()
            for t in self.tailers.values():
                t.close()
            for src in self.sources:
                src.close()

    def start(self) -> Collector:
        self._thread = threading.Thread(
            target=self.run, name=f"collector-{self.job_id}-{self.learner}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, drain: bool = True, timeout: float | None = None) -> bool:
        """Stop; with `drain`, first ship everything written so far (the learner has
        exited). Returns True when all data was shipped and committed."""
        self._drain = drain
        if timeout is not None:
            self.drain_timeout_s = timeout
        # Bounds the retries of a batch in flight too, not only the final drain.
        self._deadline = time.monotonic() + (self.drain_timeout_s if drain else 0.0)
        self._stop.set()
        waiter = self._waiter
        if waiter is not None:
            waiter.interrupt()
        if self._thread is not None:
            self._thread.join()
        self._stub.close()
        for calls, *_ in self._in_flight:  # not drained: what was never acknowledged
            for future, _again in calls:
                future.cancel()
        return (
            self.error is None
            and not self.pending_lines
            and not self.pending_samples
            and not self._in_flight
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m learner.controller.collector")
    p.add_argument("--job-id", required=True)
    p.add_argument("--learner", type=int, required=True)
    p.add_argument("--job-dir", required=True)
    p.add_argument("--tds", required=True, help="host:port of the training data service")
    p.add_argument(
        "--metric-sources", default=None, help="evaluation_metrics as JSON (mapping or list)"
    )
    p.add_argument("--batch-lines", type=int, default=5000)
    p.add_argument("--flush-interval-s", type=float, default=FLUSH_INTERVAL_S)
    p.add_argument("--drain-timeout-s", type=float, default=60.0)
    p.add_argument(
        "--verify-interval-s",
        type=float,
        default=5.0,
        help="how often to check that the TDS still holds what it acknowledged "
        "(0: never, for a store known to keep every acknowledged write)",
    )
    p.add_argument(
        "--max-in-flight",
        type=int,
        default=3,
        help="batches sent and not yet acknowledged at most (1: one at a time)",
    )
    p.add_argument(
        "--once", action="store_true", help="ship everything there is now, then exit (a drain)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s collector %(levelname)s %(message)s"
    )
    try:
        sources: Mapping[str, Any] | list[Any] | None = (
            json.loads(args.metric_sources) if args.metric_sources else None
        )
        c = Collector(
            args.job_id,
            args.learner,
            args.job_dir,
            args.tds,
            sources,
            batch_lines=args.batch_lines,
            flush_interval_s=args.flush_interval_s,
            drain_timeout_s=args.drain_timeout_s,
            verify_interval_s=args.verify_interval_s,
            max_in_flight=args.max_in_flight,
            # The job token from the environment, never argv (any local user reads argv).
            token=os.environ.get(TOKEN_ENV, ""),
            tls=tls_from_environ(),
        )
    except (CollectorError, ValueError) as exc:
        print(f"collector: {exc}", file=sys.stderr)
        return 2
    c.start()
    if args.once:
        return 0 if c.stop(drain=True) else 1
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    drain = [True]

    def interrupt(*_: Any) -> None:
        drain[0] = False  # Ctrl-C: leave now; the offsets file says where to resume
        done.set()

    signal.signal(signal.SIGINT, interrupt)
    print(f"collector running for {args.job_id} learner {args.learner}", flush=True)
    done.wait()
    return 0 if c.stop(drain=drain[0]) else 1


if __name__ == "__main__":
    sys.exit(main())
