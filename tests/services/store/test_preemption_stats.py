"""PreemptionStatsRepository against the real MongoDB-wire server fixture."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from services.embedded.process import ManagedServer
from services.store.mongo import connect
from services.store.preemption_stats import PreemptionStatsRepository

pytestmark = pytest.mark.integration


@pytest.fixture()
def repo(mongo_server: ManagedServer) -> Iterator[PreemptionStatsRepository]:
    db = connect(mongo_server.url, db_name=f"stats_{uuid.uuid4().hex[:8]}")  # type: ignore[attr-defined]
    repository = PreemptionStatsRepository(db, prior_mttp_s=3600, prior_restart_s=300)
    repository.ensure_indexes()
    yield repository
    db.client.drop_database(db.name)
    db.client.close()


def test_no_data_gives_the_prior(repo: PreemptionStatsRepository) -> None:
    est = repo.estimate("p3.2xlarge", "us-east-1a")
    assert (est.mttp_s, est.restart_s) == (3600.0, 300.0)
    assert (est.mttp_scope, est.restart_scope) == ("prior", "prior")
    assert est.learner_env() == {"RHIZOME_MTTP_S": "3600.000", "RHIZOME_RESTART_S": "300.000"}


def test_zone_estimates_count_survivors_as_censored_lifetimes(
    repo: PreemptionStatsRepository,
) -> None:
    for life in (1000.0, 2000.0, 3000.0):
        repo.record_preemption("p3.2xlarge", "us-east-1a", life, job_id="j1")
    repo.record_survival("p3.2xlarge", "us-east-1a", 6000.0)
    for wait, prep in ((60.0, 30.0), (120.0, 30.0), (90.0, 0.0)):
        repo.record_reallocation("p3.2xlarge", "us-east-1a", wait, prepare_s=prep)
    est = repo.estimate("p3.2xlarge", "us-east-1a")
    # (1000 + 2000 + 3000 + 6000) / 3 preemptions
    assert est.mttp_s == pytest.approx(4000.0)
    # (90 + 150 + 90) / 3
    assert est.restart_s == pytest.approx(110.0)
    assert (est.mttp_scope, est.restart_scope, est.preemptions) == ("zone", "zone", 3)


def test_sparse_zone_falls_back_to_the_instance_type(repo: PreemptionStatsRepository) -> None:
    for zone, life in (("us-east-1a", 100.0), ("us-east-1b", 200.0), ("us-east-1c", 300.0)):
        repo.record_preemption("g4dn.xlarge", zone, life)
    repo.record_preemption("p3.2xlarge", "us-east-1d", 9.0)  # another type: not counted
    est = repo.estimate("g4dn.xlarge", "us-east-1d")
    assert est.mttp_scope == "instance_type"
    assert est.mttp_s == pytest.approx(200.0)
    assert est.restart_scope == "prior"


def test_only_the_most_recent_window_counts(mongo_server: Any) -> None:
    db = connect(mongo_server.url, db_name=f"stats_{uuid.uuid4().hex[:8]}")
    try:
        repo = PreemptionStatsRepository(db, window=3, min_samples=3)
        repo.ensure_indexes()
        for i, life in enumerate((10_000.0, 10_000.0, 100.0, 100.0, 100.0)):
            repo.record_preemption("p3.2xlarge", "z", life, at=1000.0 + i)
        assert repo.estimate("p3.2xlarge", "z").mttp_s == pytest.approx(100.0)
    finally:
        db.client.drop_database(db.name)
        db.client.close()


def test_queries_are_served_by_an_index(repo: PreemptionStatsRepository) -> None:
    keys = [list(ix["key"].keys()) for ix in repo._col.list_indexes()]
    assert ["instance_type", "zone", "kind", "at"] in keys
    assert ["instance_type", "kind", "at"] in keys


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda r: r.record_preemption("", "z", 1.0), "instance_type must be a non-empty"),
        (lambda r: r.record_preemption("t", "z", -1.0), "lifetime_s must be >= 0"),
        (lambda r: r.record_reallocation("t", "", 1.0), "zone must be a non-empty"),
        (lambda r: r.estimate("t", ""), "zone must be a non-empty"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(
    repo: PreemptionStatsRepository, call: Any, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        call(repo)
