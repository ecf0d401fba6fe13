"""Group commit: concurrent inserts into one collection written as one ``insert_many``.

A MongoDB round trip costs the same for one document as for dozens (measured on the
embedded MongoDB-wire server: ~10x the documents per second at 50 per ``insert_many``), so
submits that arrive together are written together. The batching window is the previous
write itself, as in a database's group commit: a caller that finds no write in flight
writes at once (one client sees no added delay); callers that arrive while a write is in
flight queue up, and the next leader writes all of them in one call. No timer, no extra
thread.

Each caller sleeps on an event of its own, set once: when its document's outcome is in,
or when the leader that just finished hands it the lead (it is first in the queue).
Waking every waiter on one condition (`notify_all`) after each write cost a daemon
several context switches per submit: the callers queued for the next write woke only to
wait again, one after the other through the condition's lock (issue #18).

Each caller is acknowledged only after the call that carried its document returned, and
each gets its own outcome: ``insert_many(ordered=False)`` reports failures per document
(``writeErrors[i].index``), so a duplicate idempotency key fails only its own submit.
If the connection drops mid-write, the documents that did land are found by ``_id`` and
acknowledged; the others get the transient error and their callers retry.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pymongo.errors
from pymongo.collection import Collection

from services.store.mongo import TRANSIENT_ERRORS

DEFAULT_MAX_BATCH = 256
DUPLICATE_KEY = 11000


@dataclass
class _Pending:
    doc: dict[str, Any]
    done: bool = False
    error: BaseException | None = None
    # Set once: the outcome is in (`done`), or this caller leads the next write.
    wake: threading.Event = field(default_factory=threading.Event)


class InsertBatcher:
    """Write documents into ``collection`` in groups; ``insert`` returns once its own
    document is stored, or raises that document's own error."""

    def __init__(self, collection: Collection[Any], max_batch: int = DEFAULT_MAX_BATCH) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        self._col = collection
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._queue: list[_Pending] = []
        self._writing = False  # a leader is writing, or has been handed the lead
        # Seen by tests and benchmarks: how many writes carried how many documents.
        self.writes = 0
        self.documents = 0

    def insert(self, doc: dict[str, Any]) -> None:
        mine = _Pending(doc)
        with self._lock:
            self._queue.append(mine)
            leading = not self._writing
            self._writing = True
        if not leading:
            mine.wake.wait()
        while not mine.done:
            # Leader: take what has queued up (ours is among it unless the queue is
            # longer than one batch, in which case we lead again after this one).
            with self._lock:
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
            try:
                outcomes = self._write([p.doc for p in batch])
            except BaseException as exc:  # handed to every caller of the batch
                outcomes = [exc] * len(batch)
            for pending, outcome in zip(batch, outcomes, strict=True):
                pending.error, pending.done = outcome, True
            with self._lock:
                self.writes += 1
                self.documents += len(batch)
                following = self._queue[0] if self._queue else None
                if following is None:
                    self._writing = False
                elif mine.done:
                    following.wake.set()  # the lead passes to the first in the queue
            for pending in batch:
                if pending is not mine:
                    pending.wake.set()
        if mine.error is not None:
            raise mine.error

    def _write(self, docs: Sequence[dict[str, Any]]) -> list[BaseException | None]:
        """One ``insert_many``; the outcome of each document, in order (None: stored)."""
        try:
            self._col.insert_many(list(docs), ordered=False)
            return [None] * len(docs)
        except pymongo.errors.BulkWriteError as exc:
            outcomes: list[BaseException | None] = [None] * len(docs)
            for err in exc.details.get("writeErrors", []):
                index = int(err["index"])
                if err.get("code") == DUPLICATE_KEY:
                    outcomes[index] = pymongo.errors.DuplicateKeyError(
                        err.get("errmsg", "duplicate key"), DUPLICATE_KEY, err
                    )
                else:
                    outcomes[index] = pymongo.errors.WriteError(
                        err.get("errmsg", "write failed"), err.get("code"), err
                    )
            return outcomes
        except TRANSIENT_ERRORS as exc:
            # Some documents may have landed before the connection dropped: those are
            # stored and acknowledged; the rest retry (at the caller, with backoff).
            try:
                ids = [d["_id"] for d in docs]
                landed = {d["_id"] for d in self._col.find({"_id": {"$in": ids}}, {"_id": 1})}
            except pymongo.errors.PyMongoError:
                return [exc] * len(docs)
            return [None if d["_id"] in landed else exc for d in docs]
