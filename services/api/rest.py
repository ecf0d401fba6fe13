"""The REST gateway: FfDL-compatible routes over TrainerCore, with OpenAPI at /openapi.json.

FastAPI generates the OpenAPI document from these routes, so the spec cannot drift from
the code. Errors are JSON `{code, message}` with the matching HTTP status.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
from fastapi import Depends, FastAPI, File, Form, Header, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPBearer
from google.protobuf import json_format
from pydantic import BaseModel
from rhizome.v1 import tds_pb2, tds_pb2_grpc
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.datastructures import UploadFile as FormFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from services import __version__
from services.api import errors
from services.api.auth import Authenticator, Principal
from services.api.convert import endpoint_to_proto, job_json, timestamp, token_to_proto
from services.api.core import (
    MAX_LOG_SEARCH,
    MAX_METRIC_NAME,
    MAX_MODEL_BYTES,
    MAX_NAME_PREFIX,
    MAX_PAGE_TOKEN,
    TrainerCore,
    chunks,
)
from services.api.fast_submit import FastSubmit, FastSubmitCounts, api_error_response
from services.dashboard.app import is_dashboard_path
from services.dashboard.app import mount as mount_dashboard
from services.manifest import MAX_MANIFEST_BYTES, schema
from services.store import states
from services.store.jobs import JobRecord

log = logging.getLogger(__name__)

# Bounds of the query parameters: out-of-range values are a 400 naming the parameter,
# never an overflow further down (the gRPC messages are int32/int64).
INT32_MAX = 2**31 - 1
NDJSON = "application/x-ndjson"
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_HTTP_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
}

# A refusal by the training data service, once a stream has started.
_STREAM_ERROR_CODES = {
    grpc.StatusCode.INVALID_ARGUMENT: "bad_request",
    grpc.StatusCode.OUT_OF_RANGE: "bad_request",
    grpc.StatusCode.NOT_FOUND: "not_found",
    grpc.StatusCode.FAILED_PRECONDITION: "conflict",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "too_large",
}


class NdjsonResponse(StreamingResponse):
    """A stream of JSON objects, one a line: what the log and metric routes send."""

    media_type = NDJSON


class ErrorBody(BaseModel):
    code: str
    message: str


class PatchBody(BaseModel):
    status: str  # "halt" | "resume"


class ScaleBody(BaseModel):
    learners: int


class EventEndpointBody(BaseModel):
    """FfDL's EventEndpointRegistration: `url` (and its ignored `type`), plus an optional
    endpoint id (FfDL takes it in the path)."""

    url: str
    endpoint_id: str = ""
    type: str = ""


class TokenBody(BaseModel):
    user: str = ""  # default: the calling admin
    role: str = "user"
    expires_in_seconds: int = 0  # 0: never
    description: str = ""


class StreamQuery:
    """The query parameters of a log or metric stream beside its own filter (`search`,
    `name`): a dependency of both routes."""

    def __init__(
        self,
        follow: bool = False,
        learner: int = Query(-1, ge=-1, le=INT32_MAX),
        pos: int = Query(0, ge=INT64_MIN, le=INT64_MAX),
        pagesize: int = Query(0, ge=0, le=INT32_MAX),
        since_time: str = Query("", max_length=32),
    ) -> None:
        self.follow, self.learner, self.pos, self.pagesize = follow, learner, pos, pagesize
        self.since_time = since_time

    def fill(self, req: Any) -> Any:
        """`req` (a LogsRequest or MetricsRequest) with these parameters. FfDL's
        `since_time`: milliseconds since the epoch, or a negative number of lines counted
        back from the end (as `pos`); empty: from the start."""
        req.follow, req.learner, req.pos, req.page_size = (
            self.follow,
            self.learner,
            self.pos,
            self.pagesize,
        )
        text = self.since_time.strip()
        if not text:
            return req
        try:
            value = int(text)
        except ValueError:
            raise errors.BadRequest(
                f"since_time: {self.since_time[:40]!r} is not an integer (milliseconds since "
                "the epoch, or a negative number of lines from the end)"
            ) from None
        if value < 0:
            req.pos = value
        else:
            req.since.CopyFrom(timestamp(value / 1000))
        return req


# A log or metric stream's route function (`stream_routes` registers it at two paths).
StreamRoute = Callable[..., NdjsonResponse]


def _message_json(msg: Any) -> dict[str, Any]:
    body: dict[str, Any] = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    return body


def _job_json(job: JobRecord) -> dict[str, Any]:
    body = job_json(job)  # the proto's JSON, built without the proto (convert.py)
    body["model_id"] = job.job_id  # FfDL's name for it
    return body


def _document_errors_as_sent(document: dict[str, Any]) -> None:
    """Make the generated document say what the gateway sends on an error: FastAPI
    documents a 422 `HTTPValidationError` that is never sent (a bad request is a 400
    `{code, message}`, see validation_error), and files a streaming route's errors under
    the stream's media type although they are application/json."""
    for path_item in document.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation.get("responses", {})
            responses.pop("422", None)
            for status, response in responses.items():
                content = response.get("content")
                if status[0] in "45" and content and "application/json" not in content:
                    response["content"] = {"application/json": next(iter(content.values()))}
    schemas = document.get("components", {}).get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)


class RequestGate:
    """What every request meets first: a body over `limit` is refused (413) before it is
    read, and a caller outside `public_paths` and the dashboard is authenticated (401
    with the API's error body) before a body is read or validated, so a caller without a
    credential learns nothing from the API. The principal is left in the request's state
    (`request.state.principal`) for `caller`.

    A plain ASGI middleware, not Starlette's `@app.middleware("http")`
    (`BaseHTTPMiddleware`), which runs the rest of the app in a task of its own and pipes
    every response through a memory stream: per-request work on the gateway's one event
    loop that a submit paid for nothing (issue #18: REST cost 2x gRPC's CPU per submit).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        limit: int,
        public_paths: frozenset[str],
        authenticator: Authenticator,
    ) -> None:
        self.app = app
        self.limit = limit
        self.public_paths = public_paths
        self.authenticator = authenticator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        length = headers.get("content-length")
        if length and length.isdigit() and int(length) > self.limit:
            refusal = JSONResponse(
                {
                    "code": "too_large",
                    "message": f"request body is {length} bytes; at most {self.limit}",
                },
                status_code=413,
            )
            await refusal(scope, receive, send)
            return
        path = scope["path"]
        if path not in self.public_paths and not is_dashboard_path(path):
            try:
                principal = self.authenticator.from_http_without_lookup(headers)
                if principal is None:  # the token store must say: off the event loop
                    principal = await run_in_threadpool(self.authenticator.from_http, headers)
            except errors.ApiError as exc:
                refusal = JSONResponse(
                    {"code": exc.code, "message": exc.message}, status_code=exc.http_status
                )
                await refusal(scope, receive, send)
                return
            scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


def build_app(
    core: TrainerCore,
    tds_channel: grpc.Channel | None = None,
    auth: Authenticator | None = None,
    scheduler_channel: grpc.Channel | None = None,
    dashboard_dir: Path | None = None,
    quota_config: str = "",
) -> FastAPI:
    """`dashboard_dir`: where the dashboard keeps its session key; `quota_config`: the
    scheduler's quota file, for the dashboard's Cluster page (docs/dashboard.md)."""
    app = FastAPI(
        title="Rhizome Trainer API",
        version=__version__,
        description="Submit, watch and control training jobs. Send a token as "
        "`Authorization: Bearer rz_...` (docs/security.md).",
        responses={
            400: {"model": ErrorBody},
            401: {"model": ErrorBody},
            403: {"model": ErrorBody},
            404: {"model": ErrorBody},
            409: {"model": ErrorBody},
            413: {"model": ErrorBody},
            503: {"model": ErrorBody},
        },
    )
    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            _document_errors_as_sent(generate_openapi())
        return app.openapi_schema  # type: ignore[return-value]

    setattr(app, "openapi", openapi)  # noqa: B010
    tds = tds_pb2_grpc.TrainingDataStub(tds_channel) if tds_channel else None
    # Without an authenticator nobody gets in: no token store, no trusted header.
    authenticator = auth or Authenticator(None)
    # Declared for the OpenAPI document (its security scheme); the credential itself is
    # read by the same code path as gRPC's (services/api/auth.py).
    bearer_scheme = HTTPBearer(auto_error=False, description="a token from `rhizome token create`")

    # A coroutine, not a plain `def`: FastAPI runs a plain dependency in its thread pool,
    # one thread hop per request (and a REST submit makes one more for the store) only to
    # read what RequestGate already left in the request's state (issue #18).
    async def caller(request: Request, _: Any = Depends(bearer_scheme)) -> Principal:
        known = getattr(request.state, "principal", None)
        if known is not None:
            return known
        # Not reached behind RequestGate, which authenticates every route that asks for
        # a caller; the token store is read off the event loop all the same.
        principal: Principal = await run_in_threadpool(authenticator.from_http, request.headers)
        return principal

    async def submit(
        who: Principal, manifest: FormFile, model_definition: FormFile | None, key: str
    ) -> JSONResponse:
        """POST /v1/models once its form is read: FastAPI's route and FastSubmit both end here."""
        text = await manifest.read(MAX_MANIFEST_BYTES + 1)
        if len(text) > MAX_MANIFEST_BYTES:
            raise errors.TooLarge(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
        # The multipart parser has spooled the part to a temporary file already; the
        # core checks its size and the archive on that file.
        code: Any = b""
        if model_definition is not None:
            model_definition.file.seek(0)
            code = model_definition.file
        # In the thread pool, not on the event loop: the submit blocks on the store (and
        # may wait for a submit slot), and on the loop it held every other request back,
        # one submit at a time (which also left group commit nothing to gather).
        created = await run_in_threadpool(core.create, who, text, code, key)
        body = _job_json(created.job)
        body["existing"] = created.existing
        return JSONResponse(body, status_code=200 if created.existing else 201)

    @app.exception_handler(errors.ApiError)
    async def api_error(_: Request, exc: errors.ApiError) -> JSONResponse:
        return api_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing errors (unknown path, wrong method) in the same {code, message} shape as
        # ours.
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = dict(exc.headers or {})
        if exc.status_code == 404 and message == "Not Found":
            message = "no such route; see /openapi.json for the API"
        if exc.status_code == 405:
            # Starlette names only the first route that matched the path; a path served
            # by several routes (GET and POST /v1/models) allows all of their methods.
            allowed = sorted(
                {
                    m
                    for route in app.router.routes
                    if isinstance(route, Route) and route.matches(request.scope)[0] != Match.NONE
                    for m in (route.methods or ())
                }
            )
            headers["Allow"] = ", ".join(allowed)
            message = f"{request.method} is not allowed here; use {', '.join(allowed)}"
        return JSONResponse(
            {"code": _HTTP_CODES.get(exc.status_code, "error"), "message": message},
            status_code=exc.status_code,
            headers=headers,
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse(
            {"code": "internal", "message": "internal error; the daemon log has the details"},
            status_code=500,
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse(
            {"code": "bad_request", "message": f"{where}: {first.get('msg', 'invalid request')}"},
            status_code=400,
        )

    # What answers without a token: the document, health and version (docs/security.md).
    public_paths = {
        "/healthz",
        "/v1/version",
        "/v1/manifest-schema",
        app.openapi_url,
        app.docs_url,
        app.redoc_url,
        app.swagger_ui_oauth2_redirect_url,
    }

    # Inside RequestGate (added after it, so the gate runs first): a submit reaches it
    # authenticated, its principal in the request's state.
    app.state.fast_submits = counts = FastSubmitCounts()
    app.add_middleware(FastSubmit, submit=submit, counts=counts)
    app.add_middleware(
        RequestGate,
        limit=MAX_MODEL_BYTES + MAX_MANIFEST_BYTES + 64 * 1024,
        public_paths=frozenset(p for p in public_paths if p),
        authenticator=authenticator,
    )

    @app.get("/healthz", tags=["meta"])
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/version", tags=["meta"])
    def version() -> dict[str, str]:
        return {"version": __version__, "api": "rhizome.v1"}

    @app.get("/v1/manifest-schema", tags=["meta"])
    def manifest_schema() -> dict[str, Any]:
        return schema()

    @app.post("/v1/models", status_code=201, tags=["models"])
    async def create_model(
        manifest: UploadFile = File(..., description="manifest.yml"),
        model_definition: UploadFile | None = File(
            None,
            description=f"zipped training code, at most {MAX_MODEL_BYTES // 2**20} MiB "
            "(a multipart part: spooled to disk, never held whole in memory)",
        ),
        idempotency_key: str = Form(""),
        who: Principal = Depends(caller),
        idempotency_key_header: str | None = Header(None, alias="Idempotency-Key"),
    ) -> JSONResponse:
        # Most submits do not get here: FastSubmit answers them with the same `submit`.
        return await submit(
            who, manifest, model_definition, idempotency_key or idempotency_key_header or ""
        )

    @app.get("/v1/models", tags=["models"])
    def list_models(
        status: list[str] = Query(default_factory=list),
        name_prefix: str = Query("", max_length=MAX_NAME_PREFIX),
        page_size: int = Query(50, ge=1, le=500),
        page_token: str = Query("", max_length=MAX_PAGE_TOKEN),
        who: Principal = Depends(caller),
    ) -> dict[str, Any]:
        wanted = [s.upper() for s in status]
        unknown = [s for s in wanted if s not in states.ALL_STATES]
        if unknown:
            raise errors.BadRequest(
                f"status: unknown {', '.join(unknown)}; allowed: {', '.join(states.ALL_STATES)}"
            )
        page = core.list(who, wanted, name_prefix, page_size, page_token)
        return {
            "models": [_job_json(j) for j in page.jobs],
            "next_page_token": page.next_page_token,
        }

    @app.get("/v1/models/{model_id}", tags=["models"])
    def get_model(
        model_id: str,
        who: Principal = Depends(caller),
    ) -> dict[str, Any]:
        return _job_json(core.get(who, model_id))

    @app.patch("/v1/models/{model_id}", tags=["models"])
    def patch_model(
        model_id: str,
        body: PatchBody,
        who: Principal = Depends(caller),
    ) -> dict[str, Any]:
        action = body.status.lower()
        if action == "halt":
            return _job_json(core.halt(who, model_id))
        if action == "resume":
            return _job_json(core.resume(who, model_id))
        raise errors.BadRequest(f"status: {body.status!r} is not allowed; use 'halt' or 'resume'")

    @app.post("/v1/models/{model_id}/scale", tags=["models"])
    def scale_model(
        model_id: str,
        body: ScaleBody,
        who: Principal = Depends(caller),
    ) -> dict[str, Any]:
        return _job_json(core.scale(who, model_id, body.learners))

    @app.delete("/v1/models/{model_id}", tags=["models"])
    def delete_model(
        model_id: str,
        who: Principal = Depends(caller),
    ) -> dict[str, Any]:
        return _job_json(core.delete(who, model_id))

    def _stream(
        model_id: str, user: Principal, method: str, request: Any, follow: bool
    ) -> NdjsonResponse:
        core.get(user, model_id)  # ownership and a clear 404 before the stream starts
        if tds is None:
            raise errors.Unavailable("the training data service (tds) is not configured")

        def lines() -> Iterator[bytes]:
            call = getattr(tds, method)(request)
            try:
                for item in call:
                    yield (
                        json.dumps(
                            json_format.MessageToDict(item, preserving_proto_field_name=True)
                        )
                        + "\n"
                    ).encode()
            except grpc.RpcError as exc:
                # The status line is sent: the error is the stream's last line, coded as
                # the same refusal would be before the stream started.
                code = _STREAM_ERROR_CODES.get(exc.code(), "unavailable")
                yield (json.dumps({"code": code, "message": str(exc.details())}) + "\n").encode()
            finally:
                call.cancel()

        return NdjsonResponse(lines())

    # The document says what the stream is (one JSON object a line), not application/json.
    ndjson: dict[int | str, dict[str, Any]] = {
        200: {"description": "one JSON object a line", "content": {NDJSON: {}}}
    }

    def stream_routes(path: str, ffdl_path: str) -> Callable[[StreamRoute], StreamRoute]:
        """A stream's route, and FfDL's path of the same stream (`/v1/logs/{id}/loglines`,
        `/v1/logs/{id}/emetrics`): the same function answers both."""

        def register(route: StreamRoute) -> StreamRoute:
            for at, tag in ((ffdl_path, "ffdl aliases"), (path, "models")):
                app.get(at, tags=[tag], response_class=NdjsonResponse, responses=ndjson)(route)
            return route

        return register

    @stream_routes("/v1/models/{model_id}/logs", "/v1/logs/{model_id}/loglines")
    def get_logs(
        model_id: str,
        search: str = Query("", max_length=MAX_LOG_SEARCH),
        query: StreamQuery = Depends(),
        who: Principal = Depends(caller),
    ) -> NdjsonResponse:
        req = query.fill(tds_pb2.LogsRequest(job_id=model_id, search=search))
        return _stream(model_id, who, "GetLogs", req, query.follow)

    @stream_routes("/v1/models/{model_id}/metrics", "/v1/logs/{model_id}/emetrics")
    def get_metrics(
        model_id: str,
        name: str = Query("", max_length=MAX_METRIC_NAME),
        query: StreamQuery = Depends(),
        who: Principal = Depends(caller),
    ) -> NdjsonResponse:
        req = query.fill(tds_pb2.MetricsRequest(job_id=model_id, name=name))
        return _stream(model_id, who, "GetMetrics", req, query.follow)

    # -- downloads (FfDL) -------------------------------------------------------------------
    zip_response: dict[int | str, dict[str, Any]] = {
        200: {"description": "a zip archive", "content": {"application/zip": {}}}
    }

    @app.get(
        "/v1/models/{model_id}/definition",
        tags=["models"],
        response_class=StreamingResponse,
        responses=zip_response,
    )
    def download_definition(model_id: str, who: Principal = Depends(caller)) -> StreamingResponse:
        """The code archive the job was submitted with (gRPC DownloadModelDefinition,
        `rhizome download ID --definition`)."""
        data = core.model_definition(who, model_id)
        return StreamingResponse(
            iter([data]),
            media_type="application/zip",
            headers={"Content-Disposition": f'attachment; filename="{model_id}-definition.zip"'},
        )

    @app.get(
        "/v1/models/{model_id}/trained_model",
        tags=["models"],
        response_class=StreamingResponse,
        responses=zip_response,
    )
    def download_trained_model(
        model_id: str, who: Principal = Depends(caller)
    ) -> StreamingResponse:
        """What the job's learners wrote to their results location, as a zip of
        `<rank>/<path>` (gRPC DownloadTrainedModel, `rhizome download ID`)."""
        archive = core.trained_model(who, model_id)
        return StreamingResponse(
            chunks(archive),
            media_type="application/zip",
            headers={"Content-Disposition": f'attachment; filename="{model_id}-trained.zip"'},
        )

    # -- events (FfDL) ----------------------------------------------------------------------
    def _endpoint_json(record: Any) -> dict[str, Any]:
        return _message_json(endpoint_to_proto(record))

    def _created_endpoint(record: Any, secret: str) -> JSONResponse:
        return JSONResponse({"endpoint": _endpoint_json(record), "secret": secret}, status_code=201)

    @app.get("/v1/models/{model_id}/events", tags=["events"])
    def list_all_events(model_id: str, who: Principal = Depends(caller)) -> dict[str, Any]:
        """Every webhook of the job, of every event type (never a secret)."""
        return {"endpoints": [_endpoint_json(e) for e in core.event_endpoints(who, model_id)]}

    @app.get("/v1/models/{model_id}/events/{event_type}", tags=["events"])
    def list_events(
        model_id: str, event_type: str, who: Principal = Depends(caller)
    ) -> dict[str, Any]:
        """The job's webhooks for `event_type` (never a secret)."""
        found = core.event_endpoints(who, model_id, event_type)
        return {"endpoints": [_endpoint_json(e) for e in found]}

    @app.post("/v1/models/{model_id}/events/{event_type}", status_code=201, tags=["events"])
    def create_event(
        model_id: str, event_type: str, body: EventEndpointBody, who: Principal = Depends(caller)
    ) -> JSONResponse:
        """Register a webhook; the response holds its signing secret, and nothing later does."""
        record, secret = core.add_event_endpoint(
            who, model_id, event_type, body.url, body.endpoint_id
        )
        return _created_endpoint(record, secret)

    @app.post(
        "/v1/models/{model_id}/events/{event_type}/{endpoint_id}",
        status_code=201,
        tags=["events"],
    )
    def create_named_event(
        model_id: str,
        event_type: str,
        endpoint_id: str,
        body: EventEndpointBody,
        who: Principal = Depends(caller),
    ) -> JSONResponse:
        """FfDL's form: the caller names the endpoint in the path."""
        record, secret = core.add_event_endpoint(who, model_id, event_type, body.url, endpoint_id)
        return _created_endpoint(record, secret)

    @app.get("/v1/models/{model_id}/events/{event_type}/{endpoint_id}", tags=["events"])
    def get_event(
        model_id: str, event_type: str, endpoint_id: str, who: Principal = Depends(caller)
    ) -> dict[str, Any]:
        for endpoint in core.event_endpoints(who, model_id, event_type):
            if endpoint.endpoint_id == endpoint_id:
                return _endpoint_json(endpoint)
        raise errors.NotFound(
            f"job {model_id} has no {event_type!r} event endpoint {endpoint_id!r}"
        )

    @app.delete("/v1/models/{model_id}/events/{event_type}/{endpoint_id}", tags=["events"])
    def delete_event(
        model_id: str, event_type: str, endpoint_id: str, who: Principal = Depends(caller)
    ) -> dict[str, Any]:
        return _endpoint_json(core.delete_event_endpoint(who, model_id, event_type, endpoint_id))

    @app.post("/v1/tokens", status_code=201, tags=["tokens"])
    def create_token(body: TokenBody, who: Principal = Depends(caller)) -> dict[str, Any]:
        """Admins only. The secret is in this response and nowhere else, ever."""
        record, secret = authenticator.create_token(
            who, body.user, body.role, body.expires_in_seconds, body.description
        )
        return {"token": _message_json(token_to_proto(record)), "secret": secret}

    @app.get("/v1/tokens", tags=["tokens"])
    def list_tokens(who: Principal = Depends(caller)) -> dict[str, Any]:
        """Admins only. Never a secret."""
        return {
            "tokens": [_message_json(token_to_proto(t)) for t in authenticator.list_tokens(who)]
        }

    @app.delete("/v1/tokens/{token_id}", tags=["tokens"])
    def revoke_token(token_id: str, who: Principal = Depends(caller)) -> dict[str, Any]:
        """Admins only. The token stops working at once on this daemon, within the
        authentication cache's bound on others."""
        return _message_json(token_to_proto(authenticator.revoke_token(who, token_id)))

    # The web dashboard (docs/dashboard.md): its pages sign in with a session cookie.
    mount_dashboard(
        app, core, tds_channel, authenticator, scheduler_channel, dashboard_dir, quota_config
    )
    return app
