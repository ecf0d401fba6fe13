"""The typed manifest: every default comes from the schema, every field is typed."""

from __future__ import annotations

from services.manifest import Manifest, parse_manifest, schema
from services.store.jobs import JobRecord

MINIMAL = "name: a\nframework: {command: python train.py}\n"


def test_an_omitted_field_takes_the_schema_default() -> None:
    m = parse_manifest(MINIMAL)
    props = schema()["properties"]
    assert m.priority == props["priority"]["default"]
    assert m.max_learner_restarts == props["max_learner_restarts"]["default"]
    assert m.learners == props["learners"]["default"]
    assert m.resources.cpus == props["cpus"]["default"]
    assert m.framework.name == props["framework"]["properties"]["name"]["default"]
    ck = props["checkpoint"]["properties"]
    assert (m.checkpoint.policy, m.checkpoint.keep) == (
        ck["policy"]["default"],
        ck["keep"]["default"],
    )
    assert m.checkpoint.interval_s is None and m.checkpoint.grace_s is None
    assert m.pipeline is None and m.elastic is None


def test_every_section_is_typed() -> None:
    m = parse_manifest(
        MINIMAL
        + "pipeline: {stages: 2, pipelines: 2, microbatches: 8, metrics_every: 10}\n"
        + "checkpoint: {policy: fixed, interval_s: 60, grace_s: 20, keep: 3}\n"
        + "elastic: {min: 2, max: 8}\nzones: [z1, z2]\ninstance_type: p3.2xlarge\n"
        + "env: {SEED: 7, DEBUG: true}\n"
        + "data_stores: [{id: s, type: s3_datastore, training_data: {container: in},"
        + " connection: {secret_key: hunter2}}]\n"
    )
    assert m.pipeline is not None
    assert (m.pipeline.stages, m.pipeline.pipelines, m.pipeline.microbatches) == (2, 2, 8)
    assert m.pipeline.metrics_every == 10
    assert (
        m.pipeline.redundancy
        == schema()["properties"]["pipeline"]["properties"]["redundancy"]["default"]
    )
    assert m.learners == 4
    assert (m.checkpoint.policy, m.checkpoint.interval_s, m.checkpoint.grace_s) == (
        "fixed",
        60.0,
        20.0,
    )
    assert m.elastic is not None and (m.elastic.min, m.elastic.max) == (2, 8)
    assert m.zones == ("z1", "z2") and m.instance_type == "p3.2xlarge"
    assert m.env == {"SEED": "7", "DEBUG": "True"}
    (store,) = m.data_stores
    assert store.training_data == "in" and store.connection == {"secret_key": "hunter2"}
    assert "hunter2" not in repr(store)  # credentials stay out of logs and reprs


def test_a_stored_job_reads_back_as_the_same_typed_manifest() -> None:
    parsed = parse_manifest(MINIMAL + "priority: 80\n")
    record = JobRecord.for_manifest("job-1", "u", parsed)
    restored = JobRecord.from_doc(record.to_doc())
    assert restored.spec == Manifest.from_document(parsed.document)
    assert restored.spec.priority == 80


def test_the_api_view_of_a_job_never_shows_data_store_credentials() -> None:
    from google.protobuf import json_format

    from services.api.convert import job_to_proto

    parsed = parse_manifest(
        MINIMAL
        + "data_stores: [{id: s, type: s3_datastore, training_data: {container: in},"
        + " connection: {auth_url: 'http://x', secret_key: hunter2, access_key: AKIA1}}]\n"
    )
    record = JobRecord.for_manifest("job-1", "u", parsed)
    shown = json_format.MessageToJson(job_to_proto(record))
    assert "hunter2" not in shown and "AKIA1" not in shown
    (store,) = json_format.MessageToDict(job_to_proto(record))["manifest"]["data_stores"]
    assert store["connection"] == {"auth_url": "***", "secret_key": "***", "access_key": "***"}
    assert store["training_data"] == {"container": "in"}  # the rest is shown as given
    assert record.spec.data_stores[0].connection["secret_key"] == "hunter2"  # kept for the learner


def test_a_pipeline_jobs_metric_sources_end_with_the_runtimes_own() -> None:
    from contract import runtime_metrics

    regex = "evaluation_metrics: {type: regex_extractor, in: stdout, line_lookahead: 1}\n"
    pipe = "pipeline: {stages: 2}\n"
    # a plain job reads what its manifest names, nothing more
    assert parse_manifest(MINIMAL).metric_sources is None
    assert parse_manifest(MINIMAL + regex).metric_sources == [
        parse_manifest(MINIMAL + regex).evaluation_metrics
    ]
    # a pipeline job's runtime metrics come last, so the user's sources keep their ids
    assert parse_manifest(MINIMAL + pipe).metric_sources == [dict(runtime_metrics.SOURCE)]
    both = parse_manifest(MINIMAL + pipe + regex).metric_sources
    assert both is not None and [s["type"] for s in both] == ["regex_extractor", "emetrics_file"]
    assert both[-1] == dict(runtime_metrics.SOURCE)
