"""Where the scheduler keeps its records: in memory (tests, simulator) or MongoDB."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any

from services.scheduler.api import PlacementStore


class MemoryPlacementStore(PlacementStore):
    """The off-cluster twin of the MongoDB store: same contract, a dict behind it."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}

    def save(self, doc: Mapping[str, Any]) -> None:
        job_id = str(doc["job_id"])
        self.docs[job_id] = copy.deepcopy(dict(doc))

    def delete(self, job_id: str) -> None:
        self.docs.pop(job_id, None)

    def load_all(self) -> Iterable[Mapping[str, Any]]:
        return [copy.deepcopy(d) for d in self.docs.values()]


class MongoPlacementStore(PlacementStore):
    """Adapts services.store.placements.PlacementRepository (the only code touching pymongo)."""

    def __init__(self, repository: Any) -> None:
        self.repository = repository

    @classmethod
    def from_url(cls, url: str, database: str = "rhizome") -> MongoPlacementStore:
        from services.store.placements import PlacementRepository, connect

        return cls(PlacementRepository(connect(url).get_database(database)))

    def save(self, doc: Mapping[str, Any]) -> None:
        self.repository.save(doc)

    def delete(self, job_id: str) -> None:
        self.repository.delete(job_id)

    def load_all(self) -> Iterable[Mapping[str, Any]]:
        return list(self.repository.load_all())
