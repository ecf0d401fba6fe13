"""The LCM's view of the keys under the jobs prefix, kept by an etcd watch.

Each LCM round needs every job's guardian key (who guards it) and which jobs have keys at
all (leftovers to collect). It used to read the whole prefix every round, five times a
second whether anything changed or not: on the 2-core machine where pipeline workers
train, those reads (and their decoding in the daemon, and etcd answering them) were a
share of the platform's cost while a job ran, its learners' keys included (issue #16,
benchmarks/RESULTS.md "session 10"). A `PrefixWatch` reads the prefix once and then
delivers every change, in order, none lost across a broken stream (it re-watches from the
last revision, or reads the prefix again after a compaction), so a round reads this view
instead of etcd. A change of a guardian key (a guardian took its job, let go of it, or its
lease lapsed) calls `on_guardian_change`: the LCM's round runs at once instead of at its
next period.

The view can trail etcd by the watch's delivery (milliseconds): what the LCM does on it
is what it did on a read made at the start of a round, which trailed the round's end as
much. Where acting on a stale key would be wrong (collecting a job's leftovers: its
guardian may have just erased them), the LCM reads etcd itself (`manager.collect`).

The view also remembers which jobs' keys changed since the LCM last asked
(`take_changed`): the LCM's round between its full ones looks only at those jobs, the
jobs whose records changed in MongoDB and the few it must watch by the clock (issue #18),
and asks the view for one job's keys (`get`, `has_keys`) rather than copying it whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from contract import etcd_keys
from contract.etcd import Entry, EtcdClient
from contract.etcd_watch import Change, PrefixWatch


def is_guardian_key(key: str) -> bool:
    job_id = etcd_keys.job_of(key)
    return job_id is not None and key == etcd_keys.guardian_lease(job_id)


class JobKeys:
    def __init__(self, etcd: EtcdClient, on_guardian_change: Callable[[], None]) -> None:
        self.etcd = etcd
        self.on_guardian_change = on_guardian_change
        self._lock = threading.Lock()
        self._keys: dict[str, Entry] = {}
        self._by_job: dict[str, set[str]] = {}  # job id -> its keys in `_keys`
        # Jobs whose keys changed since `take_changed`; None: every job (a fresh read).
        self._changed: set[str] | None = set()
        self._watch: PrefixWatch | None = None

    @property
    def started(self) -> bool:
        return self._watch is not None

    def start(self) -> JobKeys:
        """Read the prefix and watch it; raises `StoreUnavailable` if etcd is unreachable
        (the caller reads etcd itself meanwhile and tries again later)."""
        watch = PrefixWatch(self.etcd, etcd_keys.jobs_prefix(), self._on_change)
        watch.start()
        self._watch = watch
        return self

    def stop(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None

    def _on_change(self, changes: list[Change], full: bool) -> None:
        """The watch's thread: apply the changes (quick: dict updates and an event)."""
        with self._lock:
            if full:
                self._keys = {}
                self._by_job = {}
                self._changed = None
            for change in changes:
                job_id = etcd_keys.job_of(change.key) or ""
                if self._changed is not None:
                    self._changed.add(job_id)
                if change.deleted:
                    if self._keys.pop(change.key, None) is not None:
                        of_job = self._by_job.get(job_id)
                        if of_job is not None:
                            of_job.discard(change.key)
                            if not of_job:
                                del self._by_job[job_id]
                    continue
                value = change.value
                # A guardian key's value names its lease (Guardian.acquire): the LCM
                # revokes a dead holder's lease rather than wait for its TTL.
                lease = value.get("lease", 0) if isinstance(value, dict) else 0
                self._keys[change.key] = Entry(
                    change.key, value, change.mod_revision, int(lease or 0)
                )
                self._by_job.setdefault(job_id, set()).add(change.key)
        if full or any(is_guardian_key(c.key) for c in changes):
            self.on_guardian_change()

    def snapshot(self) -> dict[str, Entry]:
        """Every key under the jobs prefix as last delivered (a copy)."""
        with self._lock:
            return dict(self._keys)

    def get(self, key: str) -> Entry | None:
        """One key as last delivered."""
        with self._lock:
            return self._keys.get(key)

    def has_keys(self, job_id: str) -> bool:
        """Whether job `job_id` has any key under the jobs prefix, as last delivered."""
        with self._lock:
            return job_id in self._by_job

    def take_changed(self) -> set[str] | None:
        """The jobs whose keys changed since the last call (ids; "" for a key outside any
        job), or None after a fresh read of the prefix: any job may have changed."""
        with self._lock:
            changed, self._changed = self._changed, set()
            return changed
