"""The jobs repository: the only code that reads and writes the `jobs` collection.

Every status change is a compare-and-set on the record's `version` (the fencing token,
as in torch.distributed.elastic's rendezvous `set_state(state, token)`): a writer reads
the record, checks the transition is legal, and writes only if nobody wrote in between.
History is rewritten whole rather than `$push`ed, which keeps the store correct on
MongoDB-wire servers that mishandle `$push` of sub-documents.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from typing import Any

import pymongo
import pymongo.errors
from pymongo.database import Database

from contract.checkpoints import MAX_KEPT as MAX_CHECKPOINTS
from services.manifest import Manifest
from services.store import states
from services.store.errors import IdempotencyConflict, JobNotFound, StaleToken
from services.store.group_commit import InsertBatcher
from services.store.job_index import JobIndex
from services.store.job_secrets import SECRETS_IN_FILE, JobSecrets
from services.store.mongo import TRANSIENT_ERRORS
from services.store.retry import with_retries
from services.store.stamp_reads import stamp_range

MAX_PAGE_SIZE = 500
DEFAULT_PAGE_SIZE = 50
# Fields a listing does not read: a job's checkpoint list (up to MAX_CHECKPOINTS entries)
# is for its own page and GetJob; 50 of them per row would weigh on every list.
LISTING_LEAVES_OUT = ("checkpoints",)
# How many metric names a job record keeps the last sample of (the rest are in the TDS).
MAX_LAST_METRICS = 8


class _JobIdClock:
    """Hands out job ids that sort strictly in creation order within this process.

    An id is ``job-`` + 12 hex digits of milliseconds + 4 hex digits of a sequence number
    within that millisecond + 6 hex digits naming this process. Two ids made in the same
    millisecond differ in the sequence, so they still sort in creation order (paging relies
    on it); if the wall clock steps back, ids keep counting up from the last one rather than
    going backwards. Ids from two daemons made in the same millisecond tie on time and
    sequence and are then ordered by the process suffix: arbitrary, but the same on every read.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = 0
        self._seq = 0
        self._suffix = os.urandom(3).hex()

    def next(self, now: float | None = None) -> str:
        ms = int((now if now is not None else time.time()) * 1000)
        with self._lock:
            if ms <= self._last_ms:
                ms = self._last_ms
                self._seq += 1
                if self._seq > 0xFFFF:  # 65,536 ids in one millisecond: borrow the next one
                    ms, self._seq = ms + 1, 0
            else:
                self._seq = 0
            self._last_ms = ms
            return f"job-{ms:012x}{self._seq:04x}{self._suffix}"


_id_clock = _JobIdClock()


def new_job_id(now: float | None = None) -> str:
    """Time-ordered id, strictly increasing within this process: sorting ids sorts jobs by
    creation, which paging relies on."""
    return _id_clock.next(now)


def manifest_digest(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


@dataclass
class StatusEntry:
    status: str
    time: float
    message: str = ""


@dataclass
class JobRecord:
    job_id: str
    owner: str
    name: str
    manifest: dict[str, Any]
    resources: dict[str, Any]
    status: str = states.QUEUED
    status_message: str = ""
    history: list[StatusEntry] = field(default_factory=list)
    description: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    placement: dict[str, Any] | None = None
    attempts: int = 0
    idempotency_key: str = ""
    manifest_digest: str = ""
    model_path: str = ""
    queue_reason: str = ""
    exit_code: int = 0
    last_log_lines: list[str] = field(default_factory=list)
    # The newest sample of each metric the job emits ({name, value, step, time, learner},
    # by name), kept by the TDS at a bounded rate (services/tds/last_metrics.py): the jobs
    # list shows it without asking the search server per row.
    last_metrics: list[dict[str, Any]] = field(default_factory=list)
    # The checkpoints its learners committed ({kind, step, size_bytes, time, learner,
    # name}), oldest first, the newest MAX_KEPT: reported through contract/checkpoints.py.
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    # The newest of them, {at, step}, kept beside the list so that listings (which leave
    # the list out) still tell the scheduler how much work a preemption would lose.
    last_checkpoint: dict[str, Any] = field(default_factory=dict)
    version: int = 0
    # Where the data-store credentials of `manifest` are, when the record keeps only their
    # names (services/store/job_secrets.py): "file" (the daemon's data directory); "":
    # inline (a record of an older version, or a repository without a secret store).
    secrets: str = ""
    # GPU·s (learner·s for CPU-only jobs) the job attained in its placements, written by
    # the scheduler when it releases the job (halted, ended): a resumed job keeps its
    # place in the Tiresias order across daemon restarts (services/scheduler/hosting.py).
    attained_gpu_s: float = 0.0

    @classmethod
    def for_manifest(cls, job_id: str, owner: str, manifest: Manifest, **fields: Any) -> JobRecord:
        """A new record of a validated manifest: its name, description, document and
        resources, as the API stores a submit."""
        record = cls(
            job_id=job_id,
            owner=owner,
            name=manifest.name,
            description=manifest.description,
            manifest=dict(manifest.document),
            resources=manifest.resources.as_dict(),
            **fields,
        )
        # Its typed manifest is the one given (`spec` would build the same from the
        # document): a submit reads it for admission and its answer, and need not build
        # it again (issue #18).
        record.__dict__["spec"] = manifest
        return record

    @cached_property
    def spec(self) -> Manifest:
        """The typed manifest: what services read, instead of `manifest[...]` by hand."""
        return Manifest.from_document(self.manifest)

    def to_doc(self) -> dict[str, Any]:
        # A shallow copy: dataclasses.asdict deep-copies the manifest, a measurable share
        # of a submit's CPU; pymongo only reads the document.
        doc = {f: getattr(self, f) for f in self.__dataclass_fields__}
        doc["history"] = [asdict(h) for h in self.history]
        doc["_id"] = doc["job_id"]
        # Indexes and sorts use `job_id`, not `_id`: nx-27017 cannot index `_id` in a
        # compound index.
        # Only keyed submits carry the unique idempotency field (a sparse unique index).
        doc.pop("idempotency_key")
        if self.idempotency_key:
            doc["idem"] = f"{self.owner}\x1f{self.idempotency_key}"
        return doc

    @classmethod
    def from_doc(cls, doc: dict[str, Any]) -> JobRecord:
        data = dict(doc)
        data["job_id"] = data.pop("_id")
        idem = data.pop("idem", None)
        data["idempotency_key"] = idem.split("\x1f", 1)[1] if idem else ""
        data["history"] = [StatusEntry(**h) for h in data.get("history", [])]
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Page:
    jobs: list[JobRecord]
    next_page_token: str


def _written(now: float) -> dict[str, float]:
    """The stamps of a write after the record's creation: `updated_at` (every write's) and
    `touched_at`, which creation leaves unset (`written_since`)."""
    return {"updated_at": now, "touched_at": now}


class JobsRepository:
    """Jobs in MongoDB. Every query below is served by one of the indexes in `ensure_indexes`."""

    def __init__(
        self, db: Database[Any], group_commit: bool = True, secrets: JobSecrets | None = None
    ) -> None:
        self._col = db["jobs"]
        # Where a new job's data-store credentials go instead of its record; None: inline.
        self._secrets = secrets
        # Concurrent submits share one insert_many (services/store/group_commit.py); off,
        # each is its own insert_one (the floor benchmarks/api_submit.py compares with).
        self._batcher = InsertBatcher(self._col) if group_commit else None
        # Listings page through this, not through the server's sort (job_index.py: why).
        self._index = JobIndex(self._col)
        # `set_last_metrics` and `add_checkpoints` read a list, merge, and write it back,
        # without the record's version (a metric must not fence a guardian out). The TDS
        # calls them from its thread pool, two learners' reports often at the same instant:
        # one lock per job (striped) keeps one merge from writing over the other.
        self._merge_locks = [threading.Lock() for _ in range(64)]

    def _merge_lock(self, job_id: str) -> threading.Lock:
        return self._merge_locks[zlib.crc32(job_id.encode()) % len(self._merge_locks)]

    @with_retries
    def ensure_indexes(self) -> None:
        # list/get by owner, newest first (ids are time-ordered)
        self._col.create_index([("owner", pymongo.ASCENDING), ("job_id", pymongo.DESCENDING)])
        # the scheduler's queue and the LCM's reconcile scan by status
        self._col.create_index([("status", pymongo.ASCENDING), ("job_id", pymongo.ASCENDING)])
        # a retried submit finds its job
        self._col.create_index("idem", unique=True, sparse=True)
        # the listing index's refresh reads what was written since its last read
        self._col.create_index("updated_at")
        # the scheduler's release check and the LCM's change rounds read what was written
        # since, creation aside (`written_since`, `statuses_changed_since`): only records
        # written after their creation have the field
        self._col.create_index("touched_at", sparse=True)

    # -- create -------------------------------------------------------------------
    def create(self, record: JobRecord) -> tuple[JobRecord, bool]:
        """Store a new QUEUED job. Returns (job, existing): a retried keyed submit returns
        the job stored the first time, and a reused key with another manifest is refused."""
        now = time.time()
        record.status = states.QUEUED
        record.created_at = record.updated_at = now
        record.history = [StatusEntry(states.QUEUED, now, "submitted")]
        record.manifest_digest = manifest_digest(record.manifest)  # of the values as given
        record.version = 1
        if self._secrets is not None:
            kept = self._secrets.extract(record.job_id, record.manifest)
            if kept is not None:
                record.manifest, record.secrets = kept, SECRETS_IN_FILE
                record.__dict__.pop("spec", None)  # the cached typed manifest had the values
        try:
            self._insert(record.to_doc())
        except pymongo.errors.DuplicateKeyError:
            if self._stored(record.job_id):
                # Our own earlier attempt landed before its connection dropped (job ids
                # are unique per process, so nobody else wrote this _id). Asked of the
                # store rather than read from the error: servers word it differently.
                return record, False
            if not record.idempotency_key:
                raise
            existing = self.find_by_idempotency_key(record.owner, record.idempotency_key)
            if existing is None:  # the first writer deleted it in between: store ours
                self._insert(record.to_doc())
                return record, False
            if self._secrets is not None:  # ours was not stored: neither are its credentials
                self._secrets.remove(record.job_id)
            if existing.manifest_digest != record.manifest_digest:
                raise IdempotencyConflict(record.idempotency_key, existing.job_id) from None
            return existing, True
        return record, False

    def _insert(self, doc: dict[str, Any]) -> None:
        # The first attempt without tenacity: its machinery (a state, a future with a
        # condition per attempt) cost a submit about as much CPU as the insert itself
        # (issue #18). A transient failure is retried as every store call is.
        try:
            self._insert_once(doc)
        except TRANSIENT_ERRORS:
            self._insert_retried(doc)

    def _insert_once(self, doc: dict[str, Any]) -> None:
        if self._batcher is not None:
            self._batcher.insert(doc)  # sorts out which documents of a dropped write landed
            return
        try:
            self._col.insert_one(doc)
        except pymongo.errors.DuplicateKeyError:
            raise
        except pymongo.errors.AutoReconnect:
            # The insert may have landed before the connection dropped; a retry that
            # finds the same _id means it did.
            if self._col.find_one({"_id": doc["_id"]}, {"_id": 1}) is None:
                raise

    _insert_retried = with_retries(_insert_once)

    @with_retries
    def _stored(self, job_id: str) -> bool:
        return self._col.find_one({"_id": job_id}, {"_id": 1}) is not None

    @with_retries
    def find_by_idempotency_key(self, owner: str, key: str) -> JobRecord | None:
        doc = self._col.find_one({"idem": f"{owner}\x1f{key}"})
        return JobRecord.from_doc(doc) if doc else None

    # -- read -------------------------------------------------------------------------
    @with_retries
    def get(self, job_id: str, owner: str | None = None) -> JobRecord:
        query: dict[str, Any] = {"_id": job_id}
        if owner is not None:
            query["owner"] = owner
        doc = self._col.find_one(query)
        if doc is None:
            raise JobNotFound(job_id)
        return JobRecord.from_doc(doc)

    @with_retries
    def list_page(
        self,
        owner: str | None,
        statuses: Iterable[str] = (),
        name_prefix: str = "",
        page_size: int = DEFAULT_PAGE_SIZE,
        page_token: str = "",
    ) -> Page:
        """Newest first. The page token is the last id returned (ids are time-ordered).
        Served by the process's JobIndex: one indexed read of what changed, one read of
        the page's records by id, whatever the number of jobs. The records come without
        their `checkpoints` (LISTING_LEAVES_OUT); `get` has them."""
        size = max(1, min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE))
        docs = self._index.page(
            owner, list(statuses), name_prefix, size + 1, page_token, leave_out=LISTING_LEAVES_OUT
        )
        jobs = [JobRecord.from_doc(d) for d in docs[:size]]
        token = jobs[-1].job_id if len(docs) > size else ""
        return Page(jobs, token)

    def count(self, owner: str | None, statuses: Iterable[str] = (), name_prefix: str = "") -> int:
        """How many jobs a listing with this filter has in all, as of the last listing
        (no database read; the "N jobs" of a page)."""
        return self._index.count(owner, list(statuses), name_prefix)

    @with_retries
    def by_status(self, statuses: Iterable[str], limit: int = 0) -> list[JobRecord]:
        """Oldest first: the order the scheduler and the LCM serve jobs in."""
        cursor = self._col.find({"status": {"$in": list(statuses)}}).sort(
            "job_id", pymongo.ASCENDING
        )
        if limit:
            cursor = cursor.limit(limit)
        return [JobRecord.from_doc(d) for d in cursor]

    @with_retries
    def manifests_by_status(self, statuses: Iterable[str]) -> list[tuple[str, str, dict[str, Any]]]:
        """(job_id, status, manifest) of each job in `statuses`, oldest first: all the LCM's
        round (five a second) needs. A whole record (its history, checkpoints, placement)
        was most of what the MongoDB-wire server encoded for it while a job ran (issue #16)."""
        cursor = self._col.find(
            {"status": {"$in": list(statuses)}}, {"job_id": 1, "status": 1, "manifest": 1, "_id": 0}
        ).sort("job_id", pymongo.ASCENDING)
        return [(str(d["job_id"]), str(d["status"]), dict(d.get("manifest") or {})) for d in cursor]

    @with_retries
    def statuses_changed_since(
        self, since: float, up_to: float | None = None
    ) -> list[tuple[str, str]]:
        """(job_id, status) of every job whose record was written after `since` (and at
        most at `up_to`, when given) other than by its creation, whatever its status: one
        range read on the sparse `touched_at` index, so the LCM's round between its full
        ones reads what changed, not every active job (issue #18). A creation is left out
        because the LCM has nothing to do for it: a new record is QUEUED, not active, and
        its first active status (a placement) is a later write, which this read sees. On
        the `updated_at` index the read held every new submit of the look-back, each read
        again by every round (five a second) during a burst."""
        cursor = self._col.find({"touched_at": stamp_range(since, up_to)}, {"status": 1})
        return [(str(d["_id"]), str(d.get("status", ""))) for d in cursor]

    @with_retries
    def written_since(self, since: float) -> dict[str, float]:
        """{job_id: updated_at} of every record written after `since` other than by its
        creation (every later write that moves `updated_at`: a status, a field, a
        checkpoint; not a metric nor the attained service), whatever its status: one range
        read on the sparse `touched_at` index, so the scheduler's release check reads the
        records that changed, not every placed job's (issue #18), nor the jobs submitted
        meanwhile, which no placement holds yet: during a burst of submits the
        `updated_at` range held every new record of the look-back, thousands at a time,
        each read by the MongoDB-wire server (~30 us of its CPU a record). The stamps
        tell a record written again from one read before."""
        cursor = self._col.find({"touched_at": {"$gt": since}}, {"updated_at": 1})
        return {str(d["_id"]): float(d.get("updated_at", 0.0)) for d in cursor}

    @with_retries
    def manifests_of(self, job_ids: Iterable[str]) -> list[tuple[str, str, dict[str, Any]]]:
        """(job_id, status, manifest) of each of `job_ids` still stored (read by `_id`)."""
        wanted = list(job_ids)
        if not wanted:
            return []
        cursor = self._col.find({"_id": {"$in": wanted}}, {"status": 1, "manifest": 1})
        return [
            (str(d["_id"]), str(d.get("status", "")), dict(d.get("manifest") or {})) for d in cursor
        ]

    @with_retries
    def ids_by_status(self, statuses: Iterable[str], after: str = "") -> list[str]:
        """Ids only, oldest first (only ids greater than `after` when given): the cheap
        scan the scheduling loop makes every pass."""
        query: dict[str, Any] = {"status": {"$in": list(statuses)}}
        if after:
            query["job_id"] = {"$gt": after}
        cursor = self._col.find(query, {"job_id": 1, "_id": 0}).sort("job_id", pymongo.ASCENDING)
        return [str(d["job_id"]) for d in cursor]

    @with_retries
    def get_many(self, job_ids: Iterable[str]) -> list[JobRecord]:
        wanted = list(job_ids)
        if not wanted:
            return []
        docs = self._col.find({"_id": {"$in": wanted}}).sort("job_id", pymongo.ASCENDING)
        return [JobRecord.from_doc(d) for d in docs]

    @with_retries
    def count_by_status(self) -> dict[str, int]:
        """Jobs per status, from the listing index after its refresh: the metrics gauges
        ask every few seconds, and counting on the server read every finished job."""
        self._index.refresh()
        found = self._index.count_by_status()
        return {s: found.get(s, 0) for s in states.ALL_STATES}

    # -- change -------------------------------------------------------------------------
    def transition(
        self,
        job_id: str,
        target: str,
        message: str = "",
        *,
        expect_version: int | None = None,
        owner: str | None = None,
        allow_same: bool = False,
        **fields: Any,
    ) -> JobRecord:
        """Move a job to `target`, appending to its history, by compare-and-set.

        With `expect_version` the caller holds a fencing token: a lost race raises
        StaleToken. Without it the repository re-reads and retries until the write lands
        or the transition becomes illegal (IllegalTransition)."""
        for _ in range(50):
            current = self.get(job_id, owner)
            if expect_version is not None and current.version != expect_version:
                raise StaleToken(
                    f"job {job_id} changed (version {current.version}, expected {expect_version})"
                )
            if current.status == target and allow_same:
                return current
            if not states.is_legal(current.status, target):
                raise states.IllegalTransition(job_id, current.status, target)
            now = time.time()
            history = [asdict(h) for h in current.history]
            history.append(asdict(StatusEntry(target, now, message)))
            update = {
                "status": target,
                "status_message": message,
                "history": history,
                "updated_at": now,
                "version": current.version + 1,
                **fields,
            }
            if self._cas(job_id, current.version, update):
                return self.get(job_id)
            if expect_version is not None:
                raise StaleToken(f"job {job_id} changed while being written")
        raise StaleToken(f"job {job_id}: too much contention on status writes")

    def note(self, job_id: str, message: str) -> JobRecord:
        """Append `message` to the history under the job's current status (an event that
        changes no status, e.g. a pipeline failover), by compare-and-set."""
        for _ in range(50):
            current = self.get(job_id)
            now = time.time()
            history = [asdict(h) for h in current.history]
            history.append(asdict(StatusEntry(current.status, now, message)))
            update = {
                "status_message": message,
                "history": history,
                "updated_at": now,
                "version": current.version + 1,
            }
            if self._cas(job_id, current.version, update):
                return self.get(job_id)
        raise StaleToken(f"job {job_id}: too much contention on history writes")

    def update_fields(self, job_id: str, **fields: Any) -> JobRecord:
        """Set non-status fields (placement, attempts, queue reason...) by compare-and-set."""
        for _ in range(50):
            current = self.get(job_id)
            if self._cas(
                job_id,
                current.version,
                {**fields, "updated_at": time.time(), "version": current.version + 1},
            ):
                return self.get(job_id)
        raise StaleToken(f"job {job_id}: too much contention on field writes")

    @with_retries
    def set_last_metrics(self, job_id: str, samples: Iterable[dict[str, Any]]) -> bool:
        """Merge these samples ({name, value, step, time, learner}) into the job's
        `last_metrics`, keeping per name the newer by time; at most MAX_LAST_METRICS names.

        Neither `version` nor `updated_at` moves: a metric is not a status change, so it
        must not make a guardian's fenced write stale nor every listing index re-read the
        job. Returns False when the job is not stored (purged)."""
        with self._merge_lock(job_id):
            return self._merge_last_metrics(job_id, samples)

    def _merge_last_metrics(self, job_id: str, samples: Iterable[dict[str, Any]]) -> bool:
        doc = self._col.find_one({"_id": job_id}, {"last_metrics": 1})
        if doc is None:
            return False
        merged = {str(m["name"]): m for m in doc.get("last_metrics") or [] if "name" in m}
        for m in samples:
            held = merged.get(str(m["name"]))
            if held is None or float(m["time"]) >= float(held.get("time", 0)):
                merged[str(m["name"])] = dict(m)
        # The most recently updated names win the bounded room.
        keep = sorted(merged.values(), key=lambda m: -float(m.get("time", 0)))[:MAX_LAST_METRICS]
        # A list, not a mapping by name: metric names may hold dots, which MongoDB field
        # names must not.
        self._col.update_one(
            {"_id": job_id}, {"$set": {"last_metrics": sorted(keep, key=lambda m: m["name"])}}
        )
        return True

    @with_retries
    def set_attained(self, job_id: str, gpu_s: float) -> bool:
        """Record the service the job attained so far (the scheduler's, at its release).
        Like `set_last_metrics`, neither `version` nor `updated_at` moves. False when the
        job is not stored."""
        result = self._col.update_one({"_id": job_id}, {"$set": {"attained_gpu_s": float(gpu_s)}})
        return result.matched_count > 0

    @with_retries
    def add_checkpoints(self, job_id: str, reports: Iterable[dict[str, Any]]) -> bool:
        """Merge checkpoint reports into the job's `checkpoints` (a report seen twice is
        kept once), oldest first, the newest `contract.checkpoints.MAX_KEPT`. Like
        `set_last_metrics`, `version` does not move (a report must not make a guardian's
        fenced write stale); unlike it, `updated_at` does: the scheduler's release check
        reads only the records written since its last read (`written_since`), and it is
        how `last_checkpoint` reaches the choice of a preemption victim. Saves are minutes
        apart, so the listings and the LCM re-read a record rarely for it. False when the
        job is not stored."""
        with self._merge_lock(job_id):
            return self._merge_checkpoints(job_id, reports)

    def _merge_checkpoints(self, job_id: str, reports: Iterable[dict[str, Any]]) -> bool:
        doc = self._col.find_one({"_id": job_id}, {"checkpoints": 1})
        if doc is None:
            return False

        def key(c: dict[str, Any]) -> tuple[str, str, int, float]:
            return (str(c.get("learner")), str(c.get("name")), int(c["step"]), float(c["time"]))

        merged = {key(c): c for c in doc.get("checkpoints") or []}
        for c in reports:
            merged.setdefault(key(c), dict(c))
        kept = sorted(merged.values(), key=lambda c: float(c["time"]))[-MAX_CHECKPOINTS:]
        newest = {"at": float(kept[-1]["time"]), "step": int(kept[-1]["step"])} if kept else {}
        self._col.update_one(
            {"_id": job_id},
            {"$set": {"checkpoints": kept, "last_checkpoint": newest, **_written(time.time())}},
        )
        return True

    @with_retries
    def _cas(self, job_id: str, version: int, update: dict[str, Any]) -> bool:
        if "updated_at" in update:
            update = {**update, **_written(update["updated_at"])}
        result = self._col.update_one({"_id": job_id, "version": version}, {"$set": update})
        return bool(result.modified_count == 1)

    @with_retries
    def purge(self, job_id: str) -> None:
        """Remove the record entirely (tests and retention only; users delete by transition)."""
        self._col.delete_one({"_id": job_id})
