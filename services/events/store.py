"""`EventEndpoints` in MongoDB: the `event_endpoints` collection, one document per
registered webhook (its secret among the fields: the store is the platform's own)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pymongo
import pymongo.errors

from services.events.api import (
    MAX_ENDPOINTS_PER_JOB,
    EndpointExists,
    EndpointNotFound,
    EndpointRecord,
    EventEndpoints,
    TooManyEndpoints,
)

COLLECTION = "event_endpoints"
_FIELDS = set(EndpointRecord.__dataclass_fields__)


def _record(doc: dict[str, Any]) -> EndpointRecord:
    return EndpointRecord(**{k: v for k, v in doc.items() if k in _FIELDS})


class MongoEventEndpoints(EventEndpoints):
    def __init__(self, db: Any) -> None:
        self._col = db[COLLECTION]

    def ensure_indexes(self) -> None:
        self._col.create_index([("job_id", pymongo.ASCENDING)])

    @staticmethod
    def _id(job_id: str, endpoint_id: str) -> str:
        return f"{job_id}/{endpoint_id}"

    def create(self, record: EndpointRecord) -> EndpointRecord:
        if self._col.count_documents({"job_id": record.job_id}) >= MAX_ENDPOINTS_PER_JOB:
            raise TooManyEndpoints(
                f"job {record.job_id} has {MAX_ENDPOINTS_PER_JOB} event endpoints, the most "
                "a job may have; delete one first"
            )
        doc = asdict(record)
        doc["_id"] = self._id(record.job_id, record.endpoint_id)
        doc["lease_until"] = 0.0
        doc["holder"] = ""
        try:
            self._col.insert_one(doc)
        except pymongo.errors.DuplicateKeyError:
            raise EndpointExists(
                f"job {record.job_id} already has an event endpoint {record.endpoint_id!r}; "
                "pick another id or delete that one"
            ) from None
        return record

    def for_job(self, job_id: str, event_type: str = "") -> list[EndpointRecord]:
        query: dict[str, Any] = {"job_id": job_id}
        if event_type:
            query["event_type"] = event_type
        docs = sorted(self._col.find(query), key=lambda d: (d["created_at"], d["endpoint_id"]))
        return [_record(d) for d in docs]

    def delete(self, job_id: str, event_type: str, endpoint_id: str) -> EndpointRecord:
        query = {"_id": self._id(job_id, endpoint_id), "event_type": event_type}
        doc = self._col.find_one_and_delete(query)
        if doc is None:
            raise EndpointNotFound(
                f"job {job_id} has no {event_type!r} event endpoint {endpoint_id!r}"
            )
        return _record(doc)

    def all(self) -> list[EndpointRecord]:
        return [_record(d) for d in self._col.find({})]

    def claim(self, record: EndpointRecord, holder: str, until: float, now: float) -> bool:
        result = self._col.update_one(
            {"_id": self._id(record.job_id, record.endpoint_id), "lease_until": {"$lt": now}},
            {"$set": {"lease_until": until, "holder": holder}},
        )
        return bool(result.modified_count == 1)

    def advance(self, record: EndpointRecord, holder: str, delivered: int) -> None:
        self._col.update_one(
            {"_id": self._id(record.job_id, record.endpoint_id), "holder": holder},
            {"$set": {"delivered": delivered, "lease_until": 0.0, "holder": ""}},
        )

    def forget_job(self, job_id: str) -> None:
        self._col.delete_many({"job_id": job_id})
