"""The Elasticsearch store against the real Elasticsearch-API server (noida-db)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from rhizome.v1 import tds_pb2

from services.embedded.process import ManagedServer
from services.tds.api import Query
from services.tds.es_store import ElasticsearchStore, index_slug
from tests.services.tds.helpers import log_line

pytestmark = pytest.mark.integration
T0 = 1_700_000_000_000_000


@pytest.fixture
def store(es_server: ManagedServer) -> Iterator[ElasticsearchStore]:
    st = ElasticsearchStore(es_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
    st.ensure_schema()
    yield st
    st.close()


def _job() -> str:
    return f"Job_{uuid.uuid4().hex[:6]}"  # upper case on purpose: index names must not be


def test_templates_give_job_indices_the_strict_mapping(store: ElasticsearchStore) -> None:
    job = _job()
    store.write_logs([log_line(job, 0, "stdout", 0, "hello", T0)])
    mapping = store.es.indices.get_mapping(index=store.logs_index(job))
    props = mapping[store.logs_index(job)]["mappings"]["properties"]
    assert props["line"]["type"] == "text"
    assert props["stream"]["type"] == "keyword"
    assert props["ts"]["type"] == "long"
    assert mapping[store.logs_index(job)]["mappings"]["dynamic"] == "strict"


def test_writes_are_idempotent_and_ordered(store: ElasticsearchStore) -> None:
    job = _job()
    lines = [log_line(job, i % 2, "stdout", i // 2, f"line {i}", T0 + i) for i in range(10)]
    store.write_logs(lines)
    store.write_logs(lines[3:7])  # a re-sent batch
    store.refresh(job)
    got = list(store.query_logs(Query(job)))
    assert [g.line for g in got] == [f"line {i}" for i in range(10)]
    assert got[3].time.ToMicroseconds() == T0 + 3  # exact to the microsecond
    assert store.es.count(index=store.logs_index(job))["count"] == 10


def test_paging_search_since_and_high_water(store: ElasticsearchStore) -> None:
    job = _job()
    store.write_logs(
        [log_line(job, 0, "stdout", i, f"epoch {i} loss {i / 10}", T0 + i) for i in range(12)]
        + [log_line(job, 1, "stderr", i, f"warning {i}", T0 + 100 + i) for i in range(3)]
    )
    store.refresh(job)

    def lines(**kw: object) -> list[str]:
        return [g.line for g in store.query_logs(Query(job, **kw))]  # type: ignore[arg-type]

    assert lines(pos=-2) == ["warning 1", "warning 2"]
    assert lines(pos=1, page_size=2) == ["epoch 1 loss 0.1", "epoch 2 loss 0.2"]
    assert lines(search="epoch 7") == ["epoch 7 loss 0.7"]
    assert lines(learner=1, since_us=T0 + 101) == ["warning 1", "warning 2"]
    assert lines(after={(0, "stdout"): 10, (1, "stderr"): 1}) == ["epoch 11 loss 1.1", "warning 2"]
    assert store.log_high_water(Query(job)) == {(0, "stdout"): 11, (1, "stderr"): 2}


def test_metrics_round_trip_and_delete(store: ElasticsearchStore) -> None:
    job = _job()
    samples = []
    for i in range(3):
        m = tds_pb2.MetricSample(
            job_id=job,
            learner=0,
            seq=i,
            name="loss",
            value=1 / (i + 1),
            step=i * 10,
            source="tensorboard",
        )
        m.time.FromMicroseconds(T0 + i)
        samples.append(m)
    store.write_metrics(samples)
    store.refresh(job)
    got = list(store.query_metrics(Query(job, name="loss")))
    assert [(g.step, round(g.value, 3)) for g in got] == [(0, 1.0), (10, 0.5), (20, 0.333)]
    store.delete_job(job)
    assert list(store.query_metrics(Query(job))) == []


def test_scheduled_deletions_survive_a_new_store(
    store: ElasticsearchStore, es_server: ManagedServer
) -> None:
    job = _job()
    store.schedule_deletion(job, 100.0)
    again = ElasticsearchStore(es_server.url, prefix=store.prefix)
    assert again.due_deletions(99.0) == []
    assert again.due_deletions(100.0) == [job]
    again.clear_deletion(job)
    assert store.due_deletions(1e12) == []
    again.close()


def test_index_slug_is_valid_and_distinct() -> None:
    assert index_slug("job-1") == "job-1"
    assert index_slug("Job-1") != index_slug("job-1")
    assert index_slug("a/b") == index_slug("a/b") and "/" not in index_slug("a/b")


def test_lines_with_quotes_escapes_and_unicode_are_stored_exactly(
    store: ElasticsearchStore,
) -> None:
    # The bulk body is built from templates (only the text is encoded per line): what
    # JSON must escape, and text beyond ASCII, must come back as it went in, under the
    # same document ids as before.
    job = _job()
    texts = ['a "quoted" word', "back\\slash\ttab", "é ✓ 日本", '{"not": json}', ""]
    lines = [log_line(job, r, s, i, t, T0 + i) for i, t in enumerate(texts)
             for r, s in ((0, "stdout"), (1, "stderr"))]  # fmt: skip
    store.write_logs(lines)
    store.refresh(job)
    got = sorted((g.learner, g.stream, g.seq, g.line) for g in store.query_logs(Query(job)))
    assert got == sorted((ln.learner, ln.stream, ln.seq, ln.line) for ln in lines)
    doc = store.es.get(index=store.logs_index(job), id=f"{job}-1-stderr-2")
    assert doc["_source"]["line"] == "é ✓ 日本" and doc["_source"]["seq"] == 2


def test_count_stored_counts_the_range_by_id_without_refreshing_the_index(
    es_server: ManagedServer,
) -> None:
    # Periodic refresh off: what a count sees is what it looked up, not a refreshed view.
    store = ElasticsearchStore(
        es_server.url, prefix=f"t{uuid.uuid4().hex[:8]}", refresh_interval="-1"
    )
    store.ensure_schema()
    job = _job()
    assert store.count_stored("log", job, 0, "stdout", 0, 10) == 0  # no index yet
    seqs = [s for s in range(5003) if s != 7]  # more than one lookup page, one gap
    store.write_logs([log_line(job, 0, "stdout", s, f"l{s}", T0 + s) for s in seqs])
    store.write_logs([log_line(job, 1, "stdout", s, "other learner", T0) for s in range(20)])
    store.write_logs([log_line(job, 0, "stderr", s, "other stream", T0) for s in range(20)])
    sample = tds_pb2.MetricSample(job_id=job, learner=0, seq=3, name="loss", source="logger")
    store.write_metrics([sample])
    assert store.count_stored("log", job, 0, "stdout", 0, 5003) == 5002
    assert store.count_stored("log", job, 0, "stdout", 5, 10) == 4
    assert store.count_stored("log", job, 0, "stdout", 5003, 6000) == 0
    assert store.count_stored("log", job, 1, "stdout", 0, 100) == 20
    assert store.count_stored("metric", job, 0, "logger", 0, 10) == 1
    assert store.count_stored("metric", job, 0, "tensorboard", 0, 10) == 0
    # A check costs the range, not the index: nothing was refreshed, so a search still
    # sees none of it (a refresh of the embedded server copies the whole index).
    assert list(store.query_logs(Query(job, page_size=1))) == []
    # A caller may ask for any range: one too long to look up is counted with a query.
    assert store.count_stored("log", job, 0, "stdout", 0, 1 << 40) == 5002
    store.close()
