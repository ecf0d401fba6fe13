"""Every method of the public `rhizome.v1.Trainer` service, sent what a hostile client
would send, against a real daemon (API + training data service):

- random bytes as the serialized request, and byte strings built to trip a protobuf
  parser (truncated varints, lengths past the end, invalid UTF-8 in a string field,
  unknown and group wire types, deep nesting);
- well-formed messages whose every field is at an extreme: int32/int64 minimum and
  maximum, unknown enum values, 1 MB strings, 100,000-entry repeated fields, timestamps
  outside what a datetime can hold, strings of NULs and query operators; once with made-up
  job ids and once with ids that exist, so the call gets past "not found";
- a message over the server's receive limit.

Each with a valid user token, an admin token, no token and a wrong token; a streaming
method's stream is read to its end. Every answer must be a clean status (never UNKNOWN
or INTERNAL, whose details would be an exception), its details no traceback, and the
daemon must still answer a normal call afterwards."""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory
from rhizome.v1 import tds_pb2, trainer_pb2

from contract.procs import free_port
from services.client.sdk import ClientError
from services.embedded.process import ManagedServer
from tests.integration.conftest import RunningApi, start_api

pytestmark = pytest.mark.integration

SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"]
METHODS = [m.name for m in SERVICE.methods]
MAX_RECEIVE = 80 * 1024 * 1024  # services/daemon.py
CLEAN = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
}
TRACEBACK_MARKERS = ("Traceback (most recent call last)", 'File "/', "site-packages", "Exception")
FieldDescriptor = pb_descriptor.FieldDescriptor
ELASTIC_MANIFEST = (
    "name: fuzz-elastic\nlearners: 2\nelastic: {min: 1, max: 4}\n"
    "framework:\n  command: python train.py\n"
)


@pytest.fixture(scope="module")
def api(
    mongo_server: ManagedServer, es_server: ManagedServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningApi]:
    running = start_api(
        mongo_server.url,
        Path(tmp_path_factory.mktemp("fuzz-grpc")),
        elasticsearch_url=es_server.url,
        services=("api", "tds"),
        metrics_address=f"127.0.0.1:{free_port()}",
    )
    try:
        yield running
    finally:
        running.daemon.stop()


@pytest.fixture(scope="module")
def channel(api: RunningApi) -> Iterator[grpc.Channel]:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    ch = grpc.insecure_channel(api.grpc, options=options)
    yield ch
    ch.close()


CREDENTIALS = ["user", "admin", "none", "wrong"]


def metadata(api: RunningApi, credential: str) -> list[tuple[str, str]]:
    if credential == "none":
        return []
    if credential == "wrong":
        return [("authorization", "Bearer rz_" + "B" * 43)]
    return [("authorization", f"Bearer {api.token('fuzz-' + credential, credential)}")]


def call_raw(
    channel: grpc.Channel, method: str, payload: bytes, md: list[tuple[str, str]]
) -> tuple[grpc.StatusCode, str]:
    """Send `payload` as the serialized request; read a stream to its end."""
    descriptor = SERVICE.methods_by_name[method]
    path = f"/{SERVICE.full_name}/{method}"
    try:
        if descriptor.server_streaming:
            stream = channel.unary_stream(path)(payload, metadata=md, timeout=30)
            for _ in stream:
                pass
            return stream.code(), stream.details() or ""
        channel.unary_unary(path)(payload, metadata=md, timeout=30)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def assert_clean(what: str, code: grpc.StatusCode, details: str) -> None:
    assert code in CLEAN, f"{what}: {code.name} {details[:500]!r}"
    for marker in TRACEBACK_MARKERS:
        assert marker not in details, f"{what}: the details leak internals: {details[:500]!r}"


def assert_still_serves(api: RunningApi, channel: grpc.Channel) -> None:
    md = metadata(api, "user")
    payload = trainer_pb2.ListJobsRequest(page_size=1).SerializeToString()
    code, details = call_raw(channel, "ListJobs", payload, md)
    assert code == grpc.StatusCode.OK, f"the daemon no longer serves: {code.name} {details}"


# -- (a) bytes that are not a message ------------------------------------------------------------
def malformed_payloads(seed: int, count: int = 24) -> list[bytes]:
    rng = random.Random(seed)
    crafted = [
        b"\x08",  # a varint field with no value
        b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # an 11-byte varint
        b"\x0a\xff\xff\xff\xff\x0f",  # a length far past the end
        b"\x0a\x05ab",  # a length past the end
        b"\x0a\x02\xff\xfe",  # field 1 (a string in every request) that is not UTF-8
        b"\x0a\x03\xed\xa0\x80",  # a UTF-8-encoded surrogate
        b"\x0b\x0c",  # an empty group
        b"\x0b" * 200 + b"\x0c" * 200,  # nested groups
        b"\x0f",  # wire type 7 does not exist
        b"\x00",  # field number 0
        b"\xfa\xff\xff\xff\x0f\x00",  # the largest field number, then a truncated value
        b"\x10\x80\x80\x80\x80\x80\x80\x80\x80\x80\x02",  # a varint over 64 bits
        b"\x15\x01\x02",  # a truncated fixed32
        b"\x11" + b"\xff" * 8,  # field 2 as a fixed64 where a bool or int is expected
    ]
    randoms = [rng.randbytes(rng.choice([1, 2, 5, 17, 100, 4096])) for _ in range(count)]
    return crafted + randoms


@pytest.mark.parametrize("credential", CREDENTIALS)
def test_malformed_bytes_get_a_clean_status(
    api: RunningApi, channel: grpc.Channel, credential: str
) -> None:
    md = metadata(api, credential)
    for method in METHODS:
        for i, payload in enumerate(malformed_payloads(seed=zlib.crc32(method.encode()))):
            code, details = call_raw(channel, method, payload, md)
            assert_clean(f"{method} payload {i} {payload[:24]!r}", code, details)
    assert_still_serves(api, channel)


# -- (b) well-formed messages at the extremes -----------------------------------------------------
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_ENUM: (-(2**31), 2**31 - 1),
}
MB = 1024 * 1024
ODD_STRINGS = [
    "x" * MB,
    "\x00" * 64,
    "é\u202e\ufeff" * 1000,
    "../../etc/passwd",
    '{"$gt": ""}',
    "$where",
    ".*" * 100,
    " ",
]


def _scalar(field: Any, variant: str, rng: random.Random) -> Any:
    t = field.type
    if t in _INT_RANGES:
        lo, hi = _INT_RANGES[t]
        return {"low": lo, "high": hi, "odd": rng.choice([lo, hi, -1, 0, 1])}.get(variant, hi)
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return rng.choice([float("inf"), float("-inf"), float("nan"), 1e308])
    if t == FieldDescriptor.TYPE_BOOL:
        return variant != "low"
    if t == FieldDescriptor.TYPE_STRING:
        return "x" * MB if variant in ("high", "huge") else rng.choice(ODD_STRINGS)
    if t == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(MB if variant in ("high", "huge") else rng.choice([0, 1, 64]))
    raise AssertionError(f"no extreme for field type {t}")


def extreme(descriptor: Any, variant: str, rng: random.Random, depth: int = 0) -> Any:
    """A message of type `descriptor` with every field at one extreme."""
    msg = message_factory.GetMessageClass(descriptor)()
    for field in descriptor.fields:
        repeated = field.is_repeated
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if depth < 3:
                child = extreme(field.message_type, variant, rng, depth + 1)
                if repeated:
                    getattr(msg, field.name).extend([child] * (100 if variant == "huge" else 2))
                else:
                    getattr(msg, field.name).CopyFrom(child)
            continue
        if repeated:
            n = 100_000 if variant == "huge" else 3
            if field.type == FieldDescriptor.TYPE_STRING and variant == "huge":
                values = ["x" * 10] * n
            else:
                values = [_scalar(field, variant, rng) for _ in range(min(n, 3))] * (n // 3 or 1)
            getattr(msg, field.name).extend(values)
        else:
            setattr(msg, field.name, _scalar(field, variant, rng))
    return msg


VARIANTS = ["low", "high", "huge", "odd"]


@pytest.fixture(scope="module")
def known_ids(api: RunningApi) -> dict[str, str]:
    """Ids that exist: the fuzz user's elastic job and a token an admin may revoke."""
    with api.client("fuzz-user") as rz:
        job = rz.create_job(ELASTIC_MANIFEST).job_id
    token = api.tokens.create("fuzz-victim", "user", created_by="tests").record.token_id
    return {"job_id": job, "token_id": token}


def messages(method: str, known: dict[str, str], seed: int) -> Iterator[tuple[str, bytes]]:
    rng = random.Random(seed)
    descriptor = SERVICE.methods_by_name[method].input_type
    for variant in VARIANTS:
        msg = extreme(descriptor, variant, rng)
        yield variant, msg.SerializeToString()
        # The same extremes on an id that exists, to get past "not found".
        reached = [f for f in descriptor.fields if f.name in known]
        if reached:
            for field in reached:
                setattr(msg, field.name, known[field.name])
            if "follow" in descriptor.fields_by_name:
                msg.follow = False  # a followed stream of a live job is open until it ends
            yield f"{variant} on a known id", msg.SerializeToString()


# DeleteJob last: the other methods need the known job alive.
ORDERED = sorted(METHODS, key=lambda m: (m in ("DeleteJob", "RevokeToken"), m))


@pytest.mark.parametrize("credential", CREDENTIALS)
def test_extreme_field_values_get_a_clean_status(
    api: RunningApi, channel: grpc.Channel, known_ids: dict[str, str], credential: str
) -> None:
    md = metadata(api, credential)
    for method in ORDERED:
        for variant, payload in messages(method, known_ids, seed=len(method)):
            code, details = call_raw(channel, method, payload, md)
            assert_clean(f"{method} ({variant}, {len(payload)} bytes)", code, details)
        assert_still_serves(api, channel)


# -- (c) over the receive limit -------------------------------------------------------------------
def test_a_message_over_the_receive_limit_is_resource_exhausted(
    api: RunningApi, channel: grpc.Channel
) -> None:
    # Field 1 of every request with data is a string: a well-formed message, just too big.
    body = b"x" * (MAX_RECEIVE + 1)
    payload = b"\x0a" + _varint(len(body)) + body
    for credential in ("user", "none"):
        md = metadata(api, credential)
        for method in METHODS:
            code, details = call_raw(channel, method, payload, md)
            assert_clean(f"{method} oversized", code, details)
            expected = grpc.StatusCode.RESOURCE_EXHAUSTED
            if SERVICE.methods_by_name[method].client_streaming and credential == "none":
                # A streamed upload asks who is calling before it reads a message.
                expected = grpc.StatusCode.UNAUTHENTICATED
            assert code == expected, (method, code, details)
    assert_still_serves(api, channel)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


# -- what the fuzzer found ------------------------------------------------------------------------
def test_a_refusal_by_the_training_data_service_reaches_the_caller_as_what_it_is(
    api: RunningApi, known_ids: dict[str, str]
) -> None:
    """The Trainer proxied every TDS error as UNAVAILABLE "the training data service
    failed", a bad argument included: a caller would retry what can never work."""
    with api.client("fuzz-user") as rz:
        request = tds_pb2.LogsRequest(job_id=known_ids["job_id"], learner=-(2**31))
        with pytest.raises(ClientError) as err:
            list(rz.logs(request))
    assert err.value.code == "INVALID_ARGUMENT", err.value
    assert "learner" in err.value.message
