"""The Elasticsearch store: the only module of Rhizome that imports the Elasticsearch client.

Layout (made for this data, not left to dynamic mapping):
- one index per job and kind, `rhizome-logs-<job>` and `rhizome-metrics-<job>`, so a
  job's queries scan only its own documents and deleting a job is deleting two indices;
- index templates `rhizome-logs` / `rhizome-metrics` give every such index one shard,
  no replica (set `replicas` for a real cluster), a short refresh interval (new lines are
  searchable within it) and a strict mapping: `line` is analysed text for full-text
  search, everything used to filter or sort is a keyword or a number; `ts` keeps the
  exact microsecond time the `time` date field (milliseconds) cannot;
- `rhizome-tds-deletions` holds scheduled deletions, so a retention period survives a
  TDS restart.
Document ids are deterministic (see `api`), writes are plain `index` operations: a
re-sent batch overwrites itself.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

import elasticsearch
from elasticsearch import Elasticsearch
from rhizome.v1 import tds_pb2

from contract.credentials import redact_uri
from services.tds.api import (
    Query,
    SeqKey,
    StoreRejected,
    StoreUnavailable,
    TrainingDataStore,
    log_doc_id,
    metric_doc_id,
    register_store,
    set_time_us,
    time_us,
)

T = TypeVar("T")
# The search client's timeout for one request. A bulk may take long on a search server
# that is behind; giving up on it early makes the collector send it again while the
# server still writes the first copy. The collector's deadline for a write is longer than
# this plus the TDS's longest wait for a write slot (servicer.MAX_WRITE_WAIT_S).
REQUEST_TIMEOUT_S = 60.0
_PAGE = 5000  # below index.max_result_window (10,000) so search_after pages never fail
# The longest range of records `count_stored` looks up by id (~0.6 s on the embedded
# server); a longer one is counted with a query.
LOOKUP_MAX = 50_000
_SAFE = re.compile(r"[^a-z0-9_-]")

_COMMON_PROPS: dict[str, Any] = {
    "job_id": {"type": "keyword"},
    "learner": {"type": "integer"},
    "seq": {"type": "long"},
    "ts": {"type": "long"},
    "time": {"type": "date", "format": "epoch_millis"},
}
LOG_MAPPING: dict[str, Any] = {
    "dynamic": "strict",
    "properties": {
        **_COMMON_PROPS,
        "stream": {"type": "keyword"},
        "line": {"type": "text"},
    },
}
METRIC_MAPPING: dict[str, Any] = {
    "dynamic": "strict",
    "properties": {
        **_COMMON_PROPS,
        "name": {"type": "keyword"},
        "value": {"type": "double"},
        "step": {"type": "long"},
        "source": {"type": "keyword"},
    },
}
DELETIONS_MAPPING: dict[str, Any] = {
    "dynamic": "strict",
    "properties": {"job_id": {"type": "keyword"}, "due_s": {"type": "double"}},
}


def index_slug(job_id: str) -> str:
    """A valid, collision-free index-name part for any job id (ES wants lower case)."""
    slug = _SAFE.sub("_", job_id.lower()).lstrip("_-") or "job"
    if slug != job_id or len(slug) > 80:
        slug = f"{slug[:80]}-{hashlib.sha1(job_id.encode()).hexdigest()[:10]}"
    return slug


def _translate(exc: Exception) -> Exception:
    if isinstance(exc, elasticsearch.ApiError):
        status = int(getattr(exc, "status_code", 0) or getattr(exc.meta, "status", 0) or 0)
        if status == 429 or status >= 500:
            return StoreUnavailable(f"Elasticsearch answered {status}: {exc}")
        return StoreRejected(f"Elasticsearch refused the request ({status}): {exc}")
    return StoreUnavailable(redact_uri(f"Elasticsearch unreachable: {exc}"))


_ES_ERRORS = (elasticsearch.ApiError, elasticsearch.TransportError)


# `https://HOST:9200/?tlsCAFile=/path/ca.pem`: the CA that verifies the server, named as in
# a MongoDB URI (and an etcd URL) so that every store URL reads alike.
TLS_CA_PARAM = "tlsCAFile"


def client_url(url: str) -> tuple[str, dict[str, Any]]:
    """The URL for the Elasticsearch client and its TLS options: `?tlsCAFile=PATH` on an
    https URL becomes `ca_certs` (an https URL without it trusts the system's CAs)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    ca = query.pop(TLS_CA_PARAM, [""])[0]
    if not ca:
        return url, {}
    if parts.scheme != "https":
        raise ValueError(
            f"Elasticsearch URL {redact_uri(url)!r}: {TLS_CA_PARAM} needs an https:// URL"
        )
    return urlunsplit(parts._replace(query=urlencode(query, doseq=True))), {"ca_certs": ca}


class ElasticsearchStore(TrainingDataStore):
    def __init__(
        self,
        url: str = "http://127.0.0.1:9200",
        *,
        prefix: str = "rhizome",
        refresh_interval: str = "250ms",
        replicas: int = 0,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        client: Elasticsearch | None = None,
    ) -> None:
        self.url = url
        self.prefix = prefix
        self.refresh_interval = refresh_interval
        self.replicas = replicas
        # No client-side retries: callers (collector, follow loop) own the retry policy.
        if client is None:
            bare, tls = client_url(url)
            client = Elasticsearch(bare, request_timeout=request_timeout_s, max_retries=0, **tls)
        self.es = client
        # Re-checked after an outage: a search server restarted on empty storage has no
        # templates, and indices auto-created without them would get dynamic mappings.
        self._schema_ok = False

    # -- names ----------------------------------------------------------------------
    def logs_index(self, job_id: str) -> str:
        return f"{self.prefix}-logs-{index_slug(job_id)}"

    def metrics_index(self, job_id: str) -> str:
        return f"{self.prefix}-metrics-{index_slug(job_id)}"

    @property
    def deletions_index(self) -> str:
        return f"{self.prefix}-tds-deletions"

    # -- schema ---------------------------------------------------------------------
    def ensure_schema(self) -> None:
        settings = {
            "number_of_shards": 1,
            "number_of_replicas": self.replicas,
            "refresh_interval": self.refresh_interval,
        }
        try:
            for kind, mapping in (("logs", LOG_MAPPING), ("metrics", METRIC_MAPPING)):
                self.es.indices.put_index_template(
                    name=f"{self.prefix}-{kind}",
                    index_patterns=[f"{self.prefix}-{kind}-*"],
                    template={"settings": settings, "mappings": mapping},
                    priority=100,
                )
            if not self.es.indices.exists(index=self.deletions_index):
                try:
                    self.es.indices.create(
                        index=self.deletions_index,
                        settings={"number_of_shards": 1, "number_of_replicas": self.replicas},
                        mappings=DELETIONS_MAPPING,
                    )
                except elasticsearch.BadRequestError as exc:
                    if "already_exists" not in str(exc):
                        raise
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc
        self._schema_ok = True

    # -- writes ---------------------------------------------------------------------
    def _bulk(self, body: str, count: int) -> int:
        if count == 0:
            return 0
        if not self._schema_ok:
            self.ensure_schema()
        try:
            # A prebuilt NDJSON body: the client would re-encode a list of dicts.
            resp = self.es.bulk(operations=body)  # type: ignore[arg-type]
        except _ES_ERRORS as exc:
            self._schema_ok = False
            raise _translate(exc) from exc
        if resp.get("errors"):
            failed = [item["index"] for item in resp["items"] if "error" in item.get("index", {})]
            first = failed[0] if failed else {}
            status = int(first.get("status", 500))
            msg = f"{len(failed)} of {count} documents failed; first: {first.get('error')}"
            if status == 429 or status >= 500:
                raise StoreUnavailable(msg)
            raise StoreRejected(msg)
        return count

    def write_logs(self, lines: Sequence[tds_pb2.LogLine]) -> int:
        # The bulk body is built from per-(job, learner, stream) templates: only the line's
        # text goes through json.dumps per line (two dict encodings per line were most of
        # the TDS's CPU on the ingest path). The documents are the same JSON as before.
        parts: list[str] = []
        dumps = json.dumps
        templates: dict[tuple[str, int, str], tuple[str, str]] = {}
        for ln in lines:
            key = (ln.job_id, ln.learner, ln.stream)
            template = templates.get(key)
            if template is None:
                # The document id's fixed part, encoded, without its closing quote.
                id_prefix = dumps(log_doc_id(ln.job_id, ln.learner, ln.stream, 0))[:-2]
                template = templates[key] = (
                    f'{{"index":{{"_index":{dumps(self.logs_index(ln.job_id))},"_id":{id_prefix}',
                    f'{{"job_id":{dumps(ln.job_id, ensure_ascii=False)},"learner":{ln.learner},'
                    f'"stream":{dumps(ln.stream)},"seq":',
                )
            ts = time_us(ln)
            parts.append(f'{template[0]}{ln.seq}"}}}}')
            parts.append(
                f'{template[1]}{ln.seq},"ts":{ts},"time":{ts // 1000},'
                f'"line":{dumps(ln.line, ensure_ascii=False)}}}'
            )
        return self._bulk("\n".join(parts) + "\n", len(lines))

    def write_metrics(self, samples: Sequence[tds_pb2.MetricSample]) -> int:
        parts: list[str] = []
        for s in samples:
            ts = time_us(s)
            parts.append(
                json.dumps(
                    {
                        "index": {
                            "_index": self.metrics_index(s.job_id),
                            "_id": metric_doc_id(s.job_id, s.learner, s.source, s.seq),
                        }
                    }
                )
            )
            parts.append(
                json.dumps(
                    {
                        "job_id": s.job_id,
                        "learner": s.learner,
                        "seq": s.seq,
                        "ts": ts,
                        "time": ts // 1000,
                        "name": s.name,
                        "value": s.value,
                        "step": s.step,
                        "source": s.source,
                    }
                )
            )
        return self._bulk("\n".join(parts) + "\n", len(samples))

    # -- queries --------------------------------------------------------------------
    @staticmethod
    def _filters(query: Query, key_field: str) -> tuple[list[dict[str, Any]], list[Any]]:
        filters: list[dict[str, Any]] = [{"term": {"job_id": query.job_id}}]
        must: list[Any] = []
        if query.learner is not None:
            filters.append({"term": {"learner": query.learner}})
        if query.since_us is not None:
            filters.append({"range": {"ts": {"gte": query.since_us}}})
        if query.after:
            should: list[dict[str, Any]] = []
            known: list[dict[str, Any]] = []
            for (learner, key), seq in query.after.items():
                same = [{"term": {"learner": learner}}, {"term": {key_field: key}}]
                known.append({"bool": {"filter": same}})
                should.append({"bool": {"filter": [*same, {"range": {"seq": {"gt": seq}}}]}})
            should.append({"bool": {"must_not": known}})
            filters.append({"bool": {"should": should, "minimum_should_match": 1}})
        return filters, must

    def _paged(
        self,
        index: str,
        es_query: dict[str, Any],
        sort_fields: list[str],
        query: Query,
        convert: Callable[[dict[str, Any]], T],
    ) -> Iterator[T]:
        reverse = query.pos < 0
        order = "desc" if reverse else "asc"
        sort = [{f: order} for f in sort_fields]
        # How many records the caller wants before paging, and how many to skip.
        wanted = -query.pos if reverse else None
        skip = query.pos if query.pos > 0 else 0
        limit = query.page_size if query.page_size > 0 else None
        got: list[T] = []
        search_after: list[Any] | None = None
        seen = 0
        while True:
            size = _PAGE
            if wanted is not None:
                size = min(size, wanted - seen)
                if size <= 0:
                    break
            kwargs: dict[str, Any] = {}
            if search_after is not None:
                kwargs["search_after"] = search_after
            try:
                resp = self.es.search(
                    index=index,
                    query=es_query,
                    sort=sort,
                    size=size,
                    ignore_unavailable=True,
                    track_total_hits=False,
                    **kwargs,
                )
            except _ES_ERRORS as exc:
                raise _translate(exc) from exc
            hits = resp["hits"]["hits"]
            if not hits:
                break
            for hit in hits:
                seen += 1
                if reverse:
                    got.append(convert(hit["_source"]))
                    continue
                if seen <= skip:
                    continue
                yield convert(hit["_source"])
                if limit is not None:
                    limit -= 1
                    if limit == 0:
                        return
            search_after = hits[-1]["sort"]
            if len(hits) < size:
                break
        if reverse:
            got.reverse()
            yield from (got if limit is None else got[:limit])

    def query_logs(self, query: Query) -> Iterator[tds_pb2.LogLine]:
        filters, must = self._filters(query, "stream")
        if query.search:
            must.append({"match": {"line": {"query": query.search, "operator": "and"}}})
        es_query = {"bool": {"filter": filters, "must": must}}

        def convert(src: dict[str, Any]) -> tds_pb2.LogLine:
            ln = tds_pb2.LogLine(
                job_id=src["job_id"],
                learner=src["learner"],
                stream=src["stream"],
                seq=src["seq"],
                line=src["line"],
            )
            set_time_us(ln, int(src["ts"]))
            return ln

        return self._paged(
            self.logs_index(query.job_id),
            es_query,
            ["ts", "learner", "stream", "seq"],
            query,
            convert,
        )

    def query_metrics(self, query: Query) -> Iterator[tds_pb2.MetricSample]:
        filters, must = self._filters(query, "source")
        if query.name:
            filters.append({"term": {"name": query.name}})
        es_query = {"bool": {"filter": filters, "must": must}}

        def convert(src: dict[str, Any]) -> tds_pb2.MetricSample:
            s = tds_pb2.MetricSample(
                job_id=src["job_id"],
                learner=src["learner"],
                seq=src["seq"],
                name=src["name"],
                value=float(src["value"]),
                step=int(src["step"]),
                source=src["source"],
            )
            set_time_us(s, int(src["ts"]))
            return s

        return self._paged(
            self.metrics_index(query.job_id),
            es_query,
            ["ts", "learner", "source", "seq"],
            query,
            convert,
        )

    def _high_water(
        self, index: str, es_query: dict[str, Any], key_field: str
    ) -> dict[SeqKey, int]:
        try:
            resp = self.es.search(
                index=index,
                query=es_query,
                size=0,
                ignore_unavailable=True,
                aggs={
                    "learners": {
                        "terms": {"field": "learner", "size": 10000},
                        "aggs": {
                            "keys": {
                                "terms": {"field": key_field, "size": 1000},
                                "aggs": {"top": {"max": {"field": "seq"}}},
                            }
                        },
                    }
                },
            )
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc
        out: dict[SeqKey, int] = {}
        for lb in resp.get("aggregations", {}).get("learners", {}).get("buckets", []):
            for kb in lb["keys"]["buckets"]:
                out[(int(lb["key"]), str(kb["key"]))] = int(kb["top"]["value"])
        return out

    def log_high_water(self, query: Query) -> dict[SeqKey, int]:
        filters, must = self._filters(replace(query, after={}), "stream")
        if query.search:
            must.append({"match": {"line": {"query": query.search, "operator": "and"}}})
        return self._high_water(
            self.logs_index(query.job_id), {"bool": {"filter": filters, "must": must}}, "stream"
        )

    def metric_high_water(self, query: Query) -> dict[SeqKey, int]:
        filters, must = self._filters(replace(query, after={}), "source")
        if query.name:
            filters.append({"term": {"name": query.name}})
        return self._high_water(
            self.metrics_index(query.job_id), {"bool": {"filter": filters, "must": must}}, "source"
        )

    def count_stored(
        self, kind: str, job_id: str, learner: int, key: str, from_seq: int, to_seq: int
    ) -> int:
        # The documents' ids are known (deterministic, see `api`): look them up (real-time
        # gets, no refresh) rather than count them with a query. On the embedded search
        # server a refresh copies the whole index and a query scans all of it, under its
        # one lock: in a 160,000-line index a refresh and a count of 20,000 lines took
        # 3.2 s, the lookups 0.25 s, and 8 collectors' checks held every bulk up behind
        # them (issue #18). Lookups cost the range checked, not the index; a range too
        # long to look up (a caller may ask for any) is counted with a query.
        if to_seq - from_seq > LOOKUP_MAX:
            return self._count_by_query(kind, job_id, learner, key, from_seq, to_seq)
        doc_id: Callable[[str, int, str, int], str]
        if kind == "log":
            index, doc_id = self.logs_index(job_id), log_doc_id
        else:
            index, doc_id = self.metrics_index(job_id), metric_doc_id
        found = 0
        try:
            for start in range(from_seq, to_seq, _PAGE):
                seqs = range(start, min(to_seq, start + _PAGE))
                ids = [doc_id(job_id, learner, key, s) for s in seqs]
                resp = self.es.mget(index=index, ids=ids, source=False, realtime=True)
                found += sum(1 for doc in resp["docs"] if doc.get("found"))
        except elasticsearch.NotFoundError:
            return 0  # no index yet: nothing stored
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc
        return found

    def _count_by_query(
        self, kind: str, job_id: str, learner: int, key: str, from_seq: int, to_seq: int
    ) -> int:
        index = self.logs_index(job_id) if kind == "log" else self.metrics_index(job_id)
        key_field = "stream" if kind == "log" else "source"
        query = {
            "bool": {
                "filter": [
                    {"term": {"job_id": job_id}},
                    {"term": {"learner": learner}},
                    {"term": {key_field: key}},
                    {"range": {"seq": {"gte": from_seq, "lt": to_seq}}},
                ]
            }
        }
        try:
            # Counts see only refreshed documents: refresh first, or a check made right
            # after a write would find it missing and make the collector resend.
            self.es.indices.refresh(index=index, ignore_unavailable=True)
            resp = self.es.count(index=index, query=query, ignore_unavailable=True)
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc
        return int(resp.get("count", 0))

    # -- maintenance ----------------------------------------------------------------
    def refresh(self, job_id: str) -> None:
        try:
            self.es.indices.refresh(
                index=f"{self.logs_index(job_id)},{self.metrics_index(job_id)}",
                ignore_unavailable=True,
            )
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc

    def delete_job(self, job_id: str) -> None:
        try:
            for index in (self.logs_index(job_id), self.metrics_index(job_id)):
                self.es.indices.delete(index=index, ignore_unavailable=True)
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc

    def schedule_deletion(self, job_id: str, due_s: float) -> None:
        try:
            self.es.index(
                index=self.deletions_index,
                id=job_id,
                document={"job_id": job_id, "due_s": due_s},
                refresh=True,
            )
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc

    def due_deletions(self, now_s: float) -> list[str]:
        try:
            resp = self.es.search(
                index=self.deletions_index,
                query={"range": {"due_s": {"lte": now_s}}},
                size=1000,
                ignore_unavailable=True,
            )
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc
        return sorted(h["_source"]["job_id"] for h in resp["hits"]["hits"])

    def clear_deletion(self, job_id: str) -> None:
        try:
            self.es.delete(index=self.deletions_index, id=job_id, refresh=True)
        except elasticsearch.NotFoundError:
            pass
        except _ES_ERRORS as exc:
            raise _translate(exc) from exc

    def close(self) -> None:
        self.es.close()


register_store("elasticsearch", ElasticsearchStore)
