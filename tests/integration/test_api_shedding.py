"""Overload: a submit beyond the in-flight limit is refused at once with RESOURCE_EXHAUSTED
/ HTTP 429 and a retry-after, and nothing of it is stored (services/api/shedding.py); a
slow submit does not hold back the gateway's other calls.

The daemon is a real one with a limit of one submit in flight; the test holds that one
slot itself (as a slow submit would), so the refusal is deterministic.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from rhizome.v1 import trainer_pb2, trainer_pb2_grpc

from services.api.core import TrainerCore
from services.embedded.process import ManagedServer
from tests.integration.conftest import RunningApi, start_api

pytestmark = pytest.mark.integration

MANIFEST = "name: shed\nlearners: 1\nframework:\n  command: 'true'\n"


@pytest.fixture(scope="module")
def api(
    mongo_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningApi]:
    db_url = mongo_server.url.replace("/?", "/shedding?")
    running = start_api(db_url, Path(tmp_path_factory.mktemp("shed")), max_submits_in_flight=1)
    try:
        yield running
    finally:
        running.daemon.stop()


def _core(api: RunningApi) -> TrainerCore:
    core = api.daemon.ctx.shared["trainer_core"]
    assert isinstance(core, TrainerCore)
    return core


def test_grpc_submit_over_the_limit_is_refused_with_a_retry_after(api: RunningApi) -> None:
    core = _core(api)
    with grpc.insecure_channel(api.grpc) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        md = (("authorization", f"Bearer {api.token('shed-grpc')}"),)
        with core.gate.slot(), pytest.raises(grpc.RpcError) as info:  # the one slot is taken
            stub.CreateJob(trainer_pb2.CreateJobRequest(manifest_yaml=MANIFEST), metadata=md)
        err = info.value
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "nothing was stored" in (err.details() or "")
        assert dict(err.trailing_metadata() or ())["retry-after-ms"] == "1000"
        # nothing of the refused submit was stored; once the slot is free, submits go in
        listed = stub.ListJobs(trainer_pb2.ListJobsRequest(), metadata=md)
        assert list(listed.jobs) == []
        stub.CreateJob(trainer_pb2.CreateJobRequest(manifest_yaml=MANIFEST), metadata=md)
        assert len(stub.ListJobs(trainer_pb2.ListJobsRequest(), metadata=md).jobs) == 1
    assert core.gate.shed >= 1


def test_rest_submit_over_the_limit_is_a_429_with_retry_after(api: RunningApi) -> None:
    core = _core(api)
    headers = api.headers("shed-rest")
    files = {"manifest": ("manifest.yml", MANIFEST.encode())}
    with core.gate.slot():
        resp = httpx.post(f"{api.rest}/v1/models", files=files, headers=headers, timeout=10)
    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "1"
    assert resp.json()["code"] == "overloaded"
    assert httpx.get(f"{api.rest}/v1/models", headers=headers, timeout=10).json()["models"] == []
    again = httpx.post(f"{api.rest}/v1/models", files=files, headers=headers, timeout=10)
    assert again.status_code == 201


def test_a_submit_blocked_on_the_store_does_not_hold_back_other_rest_calls(
    api: RunningApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A submit that cannot finish (the store hangs) must not stall the gateway's event
    # loop: other calls are answered meanwhile. Before the fix, REST ran the submit on
    # the loop itself, so every other request waited for it.
    core = _core(api)
    entered, release = threading.Event(), threading.Event()
    real_create = core._create

    def stuck_create(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        assert release.wait(30)
        return real_create(*args, **kwargs)

    monkeypatch.setattr(core, "_create", stuck_create)
    headers = api.headers("shed-loop")
    files = {"manifest": ("manifest.yml", MANIFEST.encode())}
    with ThreadPoolExecutor(1) as pool:
        submit = pool.submit(
            httpx.post, f"{api.rest}/v1/models", files=files, headers=headers, timeout=60
        )
        assert entered.wait(30), "the submit never reached the store"
        try:
            resp = httpx.get(f"{api.rest}/v1/models", headers=headers, timeout=10)
            assert resp.status_code == 200  # answered while the submit is still stuck
            assert not submit.done()
        finally:
            release.set()
        assert submit.result(timeout=60).status_code == 201
