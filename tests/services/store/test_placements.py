from __future__ import annotations

from collections.abc import Iterator

import pymongo
import pytest
from pymongo.database import Database

from services.embedded.process import ManagedServer
from services.store.placements import PlacementRepository

pytestmark = pytest.mark.integration


@pytest.fixture
def db(mongo_server: ManagedServer) -> Iterator[Database[dict[str, object]]]:
    client: pymongo.MongoClient[dict[str, object]] = pymongo.MongoClient(mongo_server.url)
    try:
        yield client.get_database("placements_test")
    finally:
        client.drop_database("placements_test")
        client.close()


def test_save_replaces_by_job_id_and_keeps_first_saved_order(
    db: Database[dict[str, object]],
) -> None:
    repo = PlacementRepository(db)
    repo.save({"job_id": "b", "state": "queued", "request": {"learners": 2}})
    repo.save({"job_id": "a", "state": "queued", "request": {"learners": 1}})
    repo.save(
        {
            "job_id": "b",
            "state": "reserved",
            "learner_nodes": ["n0", "n1"],
            "request": {"learners": 2},
        }
    )
    docs = repo.load_all()
    assert [d["job_id"] for d in docs] == ["b", "a"]
    assert docs[0]["state"] == "reserved" and docs[0]["learner_nodes"] == ["n0", "n1"]
    assert docs[0]["request"] == {"learners": 2}
    assert [d["job_id"] for d in repo.by_state("queued")] == ["a"]
    assert db["scheduler_placements"].count_documents({"job_id": "b"}) == 1


def test_delete_is_idempotent_and_indexes_exist(db: Database[dict[str, object]]) -> None:
    repo = PlacementRepository(db)
    repo.save({"job_id": "x", "state": "bound"})
    repo.delete("x")
    repo.delete("x")
    assert repo.get("x") is None
    names = {ix["name"] for ix in db["scheduler_placements"].list_indexes()}
    assert {"job_id_unique", "state"} <= names


def test_a_record_without_a_job_id_is_refused(db: Database[dict[str, object]]) -> None:
    with pytest.raises(ValueError, match="job_id"):
        PlacementRepository(db).save({"state": "queued"})
