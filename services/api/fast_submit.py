"""POST /v1/models without FastAPI's per-request machinery (issue #18): `FastSubmit`, an
ASGI middleware of the REST gateway (services/api/rest.py), and how the gateway answers an
API error (`api_error_response`), which FastSubmit answers as the app does."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import FormData, Headers
from starlette.datastructures import UploadFile as FormFile
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.api import errors
from services.api.auth import Principal


def api_error_response(exc: errors.ApiError) -> JSONResponse:
    """An ApiError as the gateway answers it: `{code, message}`, its status and headers."""
    return JSONResponse(
        {"code": exc.code, "message": exc.message},
        status_code=exc.http_status,
        headers=exc.http_headers(),
    )


# A submit whose body is at most this large may take FastSubmit's path (its form is held
# in memory while it is read); a larger one, a code archive spooled to disk, goes to
# FastAPI's route, where the upload costs far more than the route does.
FAST_SUBMIT_BYTES = 1024 * 1024
SUBMIT_PATH = "/v1/models"
# POST /v1/models's form fields (create_model's parameters).
_MANIFEST, _MODEL, _KEY = "manifest", "model_definition", "idempotency_key"

# What FastSubmit hands a submit to: the principal, the manifest part, the code part (or
# None) and the idempotency key.
SubmitFn = Callable[[Principal, FormFile, FormFile | None, str], Awaitable[Response]]


@dataclass
class FastSubmitCounts:
    """Submits FastSubmit answered itself, and those it read and handed to FastAPI's route."""

    answered: int = 0
    handed_on: int = 0


class FastSubmit:
    """POST /v1/models without FastAPI's per-request machinery (issue #18).

    For every request FastAPI solves the route's dependencies and validates its form
    fields with pydantic: about 0.2 ms of the gateway's one event loop per submit, a
    sixth of a REST submit's daemon CPU. A submit of the documented form (one
    `manifest` file part, at most one `model_definition` file part, at most one
    `idempotency_key` field) whose body is at most FAST_SUBMIT_BYTES is read here with
    Starlette's form parser (the one FastAPI's route uses, with the same limits) and
    handed to the route's own `submit`; its errors are answered as the app's ApiError
    handler answers them. Anything else (a larger or chunked upload, a body that is not
    such a form, a form the parser refuses) goes on to FastAPI's route with the messages
    read so far replayed, so its answer, error or not, is the route's own.
    """

    def __init__(self, app: ASGIApp, *, submit: SubmitFn, counts: FastSubmitCounts) -> None:
        self.app = app
        self.submit = submit
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        principal = scope.get("state", {}).get("principal") if scope["type"] == "http" else None
        if (
            principal is None  # only RequestGate's authenticated requests; the rest as ever
            or scope["path"] != SUBMIT_PATH
            or scope["method"] != "POST"
            or not _small_body(Headers(scope=scope))
        ):
            await self.app(scope, receive, send)
            return
        received: list[Message] = []

        async def recording() -> Message:
            message = await receive()
            received.append(message)
            return message

        request = Request(scope, recording)
        try:
            form = await request.form()
        except Exception:  # the route reads it again and answers as it does
            form = None
        fields = _submit_fields(form) if form is not None else None
        if form is None or fields is None:
            if form is not None:
                await form.close()
            self.counts.handed_on += 1
            await self.app(scope, _replay(received, receive), send)
            return
        manifest, model, key = fields
        try:
            response = await self.submit(
                principal, manifest, model, key or request.headers.get("idempotency-key") or ""
            )
        except errors.ApiError as exc:
            response = api_error_response(exc)
        finally:
            await form.close()
        self.counts.answered += 1
        await response(scope, receive, send)


def _small_body(headers: Headers) -> bool:
    """A body of a declared length up to FAST_SUBMIT_BYTES (a chunked one has none)."""
    length = headers.get("content-length")
    return bool(length and length.isdigit() and int(length) <= FAST_SUBMIT_BYTES)


def _submit_fields(form: FormData) -> tuple[FormFile, FormFile | None, str] | None:
    """The submit's (manifest, code, idempotency key) when the form has the documented
    shape, where FastAPI's validation would pass it as it is; None otherwise."""
    manifests, models, keys = (form.getlist(f) for f in (_MANIFEST, _MODEL, _KEY))
    if len(manifests) != 1 or not isinstance(manifests[0], FormFile):
        return None
    if len(models) > 1 or (models and not isinstance(models[0], FormFile)):
        return None
    if len(keys) > 1 or (keys and not isinstance(keys[0], str)):
        return None
    model = models[0] if models else None
    return manifests[0], model, keys[0] if keys else ""  # type: ignore[return-value]


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """`receive` that first gives back `messages` (what a reader took already)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
