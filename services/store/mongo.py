"""The MongoDB connection: one place that knows how to reach it and how to say it cannot."""

from __future__ import annotations

from typing import Any

import pymongo
import pymongo.errors
from pymongo.database import Database

from contract.credentials import redact_uri
from services.store.errors import StoreUnavailable

DEFAULT_DB = "rhizome"

# Transient errors worth a retry: the server restarted, a socket dropped, an election.
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    pymongo.errors.AutoReconnect,
    pymongo.errors.NetworkTimeout,
    pymongo.errors.ServerSelectionTimeoutError,
)


def database_name(uri: str) -> str:
    """The database named in the URI's path (mongodb://host/NAME), else `rhizome`."""
    from pymongo.uri_parser import parse_uri

    return str(parse_uri(uri).get("database") or DEFAULT_DB)


def connect(uri: str, db_name: str | None = None, timeout_ms: int = 5000) -> Database[Any]:
    """Return the database (the URI's, else `rhizome`), or raise StoreUnavailable naming the URI
    (its password redacted)."""
    client: pymongo.MongoClient[Any] = pymongo.MongoClient(
        uri,
        serverSelectionTimeoutMS=timeout_ms,
        connectTimeoutMS=timeout_ms,
        retryWrites=False,  # wire-compatible servers without replica sets refuse retryable writes
        tz_aware=False,
    )
    try:
        client.admin.command("ping")
    except pymongo.errors.PyMongoError as exc:
        client.close()
        raise StoreUnavailable(
            f"MongoDB at {redact_uri(uri)} is unreachable ({type(exc).__name__}); start it with "
            "`rhizome up --embedded` or point --mongodb-uri / RHIZOME_MONGODB_URI at a running one"
        ) from exc
    return client[db_name or database_name(uri)]
