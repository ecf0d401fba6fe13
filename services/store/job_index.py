"""A newest-first index of the jobs collection, kept in the process that lists jobs.

Why: the default MongoDB-wire server (SecantusDB) serves a filter from an index but not a
sort: `find().sort(job_id, -1).limit(51)` reads and sorts every record, 2.5 s with 10,000
jobs on the shared machine, so the jobs list (CLI, REST, gRPC, the dashboard) grew with
the number of jobs ever stored. What it does serve from an index is a point read by `_id`
and a range on an indexed field. So the repository keeps, per process, the four small
fields a listing filters on (id, owner, name, status) for every job, sorted by id:

- filled once by one projected scan (the first listing after a start pays it);
- brought up to date before every listing (and every refresh of the job gauges, every
  5 s) by an indexed range read of the records written since the last one (every
  repository write sets `updated_at`, a creation too), which sees new jobs and status
  changes from any process: those stamped since the last read began, less MARGIN_S, and
  every BAND_S the band of stamps that has just become older than LOOKBACK_S, for a write
  that landed after the read that passed its stamp (services/store/stamp_reads.py). Each
  record is so read about twice; every read asked for the whole look-back again before,
  and a burst of submits was read by every gauge refresh for 30 s (seven times) and by
  every listing meanwhile;
- a page is then chosen here and its records fetched by `_id` (`$in`, one read), and each
  fetched record is checked against the filter again, so a status that changed after the
  last refresh is never shown under the wrong filter (the stale entry is corrected and the
  next candidate taken).

What it assumes: a write becomes visible within LOOKBACK_S of the `updated_at` its writer
stamped (clock skew between daemons plus write latency); one within MARGIN_S is in the
next listing, a later one within BAND_S + LOOKBACK_S. Owner and name never change
after a submit, so only the status can be stale, and the recheck covers that.
Memory: about 200 bytes a job (2 MB for 10,000).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

from pymongo.collection import Collection as MongoCollection

from services.store.stamp_reads import StampedReads, stamp_range

LOOKBACK_S = 30.0
MARGIN_S = 2.0
BAND_S = 5.0
_FIELDS = {"owner": 1, "name": 1, "status": 1}


class JobIndex:
    def __init__(
        self,
        col: MongoCollection[Any],
        lookback_s: float = LOOKBACK_S,
        clock: Callable[[], float] = time.time,
        margin_s: float = MARGIN_S,
        band_s: float = BAND_S,
    ) -> None:
        self._col = col
        self._clock = clock
        self._reads = StampedReads(lookback_s, margin_s, band_s, clock)
        self._lock = threading.Lock()
        self._refreshing = threading.Lock()
        self._ids: list[str] = []  # ascending
        self._rows: dict[str, tuple[str, str, str]] = {}  # id -> (owner, name, status)
        self._loaded = False

    def refresh(self) -> None:
        """Read what changed since the last refresh (everything, the first time)."""
        with self._refreshing:
            if self._loaded:
                docs = self._reads.read(self._written)
            else:
                started = self._clock()
                docs = list(self._col.find({}, _FIELDS))
                self._reads.reset(started)
            with self._lock:
                fresh = not self._loaded
                for doc in docs:
                    self._put(str(doc["_id"]), doc)
                if fresh:
                    self._ids.sort()
                self._loaded = True

    def _written(self, after: float, up_to: float | None) -> list[dict[str, Any]]:
        return list(self._col.find({"updated_at": stamp_range(after, up_to)}, _FIELDS))

    def _put(self, job_id: str, doc: dict[str, Any]) -> None:
        if job_id not in self._rows:
            if not self._loaded or not self._ids or job_id > self._ids[-1]:
                self._ids.append(job_id)  # the first load sorts once at its end
            else:
                bisect.insort(self._ids, job_id)
        self._rows[job_id] = (
            str(doc.get("owner", "")),
            str(doc.get("name", "")),
            str(doc.get("status", "")),
        )

    def _forget(self, job_id: str) -> None:
        if self._rows.pop(job_id, None) is not None:
            at = bisect.bisect_left(self._ids, job_id)
            if at < len(self._ids) and self._ids[at] == job_id:
                del self._ids[at]

    @staticmethod
    def _matches(
        row: tuple[str, str, str], owner: str | None, statuses: Collection[str], prefix: str
    ) -> bool:
        return (
            (owner is None or row[0] == owner)
            and (not statuses or row[2] in statuses)
            and row[1].startswith(prefix)
        )

    def _candidates(
        self, owner: str | None, statuses: Collection[str], prefix: str, before: str
    ) -> Iterator[str]:
        """Ids that match by the index, newest first, below `before` (all when empty)."""
        with self._lock:
            at = bisect.bisect_left(self._ids, before) if before else len(self._ids)
            snapshot = self._ids[:at]
        for job_id in reversed(snapshot):
            row = self._rows.get(job_id)
            if row is not None and self._matches(row, owner, statuses, prefix):
                yield job_id

    def page(
        self,
        owner: str | None,
        statuses: Collection[str],
        prefix: str,
        limit: int,
        before: str = "",
        leave_out: Collection[str] = (),
    ) -> list[dict[str, Any]]:
        """Up to `limit` records matching the filter, newest first, ids below `before`;
        every one checked against the filter as stored now. `leave_out` names fields not
        to read (a listing does not need a job's checkpoint list)."""
        self.refresh()
        found: list[dict[str, Any]] = []
        candidates = self._candidates(owner, statuses, prefix, before)
        while len(found) < limit:
            batch = [c for _, c in zip(range(limit - len(found)), candidates, strict=False)]
            if not batch:
                break
            projection = {f: 0 for f in leave_out} or None
            found_docs = self._col.find({"_id": {"$in": batch}}, projection)
            docs = {str(d["_id"]): d for d in found_docs}
            with self._lock:
                for job_id in batch:
                    doc = docs.get(job_id)
                    if doc is None:  # purged since the index saw it
                        self._forget(job_id)
                        continue
                    self._put(job_id, doc)
                    if self._matches(self._rows[job_id], owner, statuses, prefix):
                        found.append(doc)
        return found

    def count(self, owner: str | None, statuses: Collection[str] = (), prefix: str = "") -> int:
        """How many jobs match, as of the last refresh (the last listing): no database read."""
        with self._lock:
            return sum(
                1 for row in self._rows.values() if self._matches(row, owner, statuses, prefix)
            )

    def count_by_status(self) -> dict[str, int]:
        """Jobs per status, as of the last refresh."""
        counts: dict[str, int] = {}
        with self._lock:
            for _, _, status in self._rows.values():
                counts[status] = counts.get(status, 0) + 1
        return counts
