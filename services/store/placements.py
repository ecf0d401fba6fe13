"""MongoDB repository for the scheduler's persisted decisions: queue entries and reservations.

One document per job, keyed by ``job_id`` (unique index), with a ``state`` field
(``queued`` / ``reserved`` / ``bound``, indexed) and whatever else the scheduler
records. The scheduler writes a document before it answers the call that changed it,
so after a restart it reloads exactly what it had promised: no lost reservation, no
GPU booked twice. Only standard MongoDB operations are used, so a real mongod,
SecantusDB and nx-27017 all serve it (no ``$push``: see services/embedded/servers.py).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from pymongo import ASCENDING, MongoClient
from pymongo.database import Database

COLLECTION = "scheduler_placements"


def connect(url: str, timeout_ms: int = 5000) -> MongoClient[Any]:
    """A client for ``url`` that fails within ``timeout_ms`` when the server is away."""
    return MongoClient(url, serverSelectionTimeoutMS=timeout_ms, tz_aware=True)


class PlacementRepository:
    """Scheduler records in ``db[collection]``; creates its own indexes."""

    def __init__(self, db: Database[Any], collection: str = COLLECTION) -> None:
        self._coll = db[collection]
        self._coll.create_index([("job_id", ASCENDING)], unique=True, name="job_id_unique")
        self._coll.create_index([("state", ASCENDING)], name="state")
        self._coll.create_index([("first_saved_ns", ASCENDING)], name="first_saved")

    def save(self, doc: Mapping[str, Any]) -> None:
        """Insert or replace the record of ``doc['job_id']``, keeping its first-saved time."""
        job_id = doc.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise ValueError(f"a placement record needs a non-empty string job_id, got {job_id!r}")
        body = {k: v for k, v in doc.items() if k not in ("_id", "first_saved_ns")}
        self._coll.update_one(
            {"job_id": job_id},
            {"$set": body, "$setOnInsert": {"first_saved_ns": time.time_ns()}},
            upsert=True,
        )

    def get(self, job_id: str) -> dict[str, Any] | None:
        doc = self._coll.find_one({"job_id": job_id}, {"_id": 0, "first_saved_ns": 0})
        return dict(doc) if doc is not None else None

    def delete(self, job_id: str) -> None:
        self._coll.delete_one({"job_id": job_id})

    def load_all(self) -> list[dict[str, Any]]:
        """Every record, oldest first."""
        cursor = self._coll.find({}, {"_id": 0}).sort(
            [("first_saved_ns", ASCENDING), ("job_id", ASCENDING)]
        )
        out = []
        for doc in cursor:
            doc = dict(doc)
            doc.pop("first_saved_ns", None)
            out.append(doc)
        return out

    def by_state(self, state: str) -> list[dict[str, Any]]:
        cursor = self._coll.find({"state": state}, {"_id": 0, "first_saved_ns": 0})
        return [dict(d) for d in cursor.sort([("job_id", ASCENDING)])]
