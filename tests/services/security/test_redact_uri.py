"""`redact_uri`: the one helper every error and log line prints a store URI through."""

from __future__ import annotations

import logging

import pytest

from contract.credentials import redact_uri
from services.api.auth import RedactingFilter
from services.store.errors import StoreUnavailable
from services.store.mongo import connect

PASSWORD = "Hunter2-pw"


@pytest.mark.parametrize(
    "uri, shown",
    [
        (
            f"mongodb://rz:{PASSWORD}@db:27017/x?authSource=admin",
            "mongodb://rz:***@db:27017/x?authSource=admin",
        ),
        (
            f"mongodb+srv://rz:{PASSWORD}@a.example,b.example/x",
            "mongodb+srv://rz:***@a.example,b.example/x",
        ),
        (
            f"http://root:{PASSWORD}@127.0.0.1:2379/?tlsCAFile=/a.pem",
            "http://root:***@127.0.0.1:2379/?tlsCAFile=/a.pem",
        ),
        (f"https://elastic:p@ss{PASSWORD}@es:9200", "https://elastic:***@es:9200"),
        (f"mongodb://db/x?password={PASSWORD}&w=1", "mongodb://db/x?password=***&w=1"),
        (f"s3://b/k?X-Amz-Signature={PASSWORD}", "s3://b/k?X-Amz-Signature=***"),
    ],
)
def test_redact_uri_hides_the_password_and_keeps_the_rest(uri: str, shown: str) -> None:
    assert redact_uri(f"store at {uri} is down") == f"store at {shown} is down"


@pytest.mark.parametrize(
    "text",
    [
        "mongodb://db:27017/rhizome",
        "http://127.0.0.1:2379",
        "https://es:9200/?tlsCAFile=/ca.pem",
        "a:b@c",
    ],
)
def test_redact_uri_leaves_uris_without_secrets_alone(text: str) -> None:
    assert redact_uri(text) == text


def test_mongo_unreachable_error_names_the_uri_without_its_password() -> None:
    with pytest.raises(StoreUnavailable) as err:
        connect(f"mongodb://rz:{PASSWORD}@127.0.0.1:1/db", timeout_ms=200)
    assert PASSWORD not in str(err.value)
    assert "mongodb://rz:***@127.0.0.1:1/db" in str(err.value)


def test_log_filter_redacts_uri_passwords() -> None:
    record = logging.LogRecord(
        "x", logging.INFO, __file__, 1, "cannot reach %s", (f"mongodb://rz:{PASSWORD}@h/x",), None
    )
    RedactingFilter().filter(record)
    assert record.getMessage() == "cannot reach mongodb://rz:***@h/x"


def test_a_malformed_etcd_url_is_named_without_its_password() -> None:
    from contract.etcd import parse_url

    with pytest.raises(ValueError) as err:
        parse_url(f"http://root:{PASSWORD}@h")  # no port
    assert PASSWORD not in str(err.value) and "root:***@h" in str(err.value)
