"""The REST gateway: FfDL-compatible routes over TrainerCore, with OpenAPI at /openapi.json.

FastAPI generates the OpenAPI document from these routes, so the spec cannot drift from
the code. Errors are JSON `{code, message}` with the matching HTTP status.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import grpc
from fastapi import FastAPI, File, Form, Header, Query, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from google.protobuf import json_format
from pydantic import BaseModel
from rhizome.v1 import tds_pb2, tds_pb2_grpc
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route

from services import __version__
from services.api import errors
from services.api.convert import job_to_proto
from services.api.core import MAX_MODEL_BYTES, TrainerCore
from services.manifest import MAX_MANIFEST_BYTES, schema
from services.store import states
from services.store.jobs import JobRecord

log = logging.getLogger(__name__)

# Bounds of the query parameters: out-of-range values are a 400 naming the parameter,
# never an overflow further down (the gRPC messages are int32/int64).
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_HTTP_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
}

# FfDL sent the user as `X-Watson-Userinfo: bluemix-instance-id=<user>`; both are accepted.
USER_HEADER = "X-Rhizome-User"


class ErrorBody(BaseModel):
    code: str
    message: str


class PatchBody(BaseModel):
    status: str  # "halt" | "resume"


class ScaleBody(BaseModel):
    learners: int


def _user(rhizome_user: str | None, watson: str | None) -> str:
    if rhizome_user:
        return rhizome_user
    if watson and "bluemix-instance-id=" in watson:
        return watson.split("bluemix-instance-id=", 1)[1].split(";")[0].strip()
    return ""


def _job_json(job: JobRecord) -> dict[str, Any]:
    body: dict[str, Any] = json_format.MessageToDict(
        job_to_proto(job), preserving_proto_field_name=True
    )
    body["model_id"] = job.job_id  # FfDL's name for it
    return body


def build_app(core: TrainerCore, tds_channel: grpc.Channel | None = None) -> FastAPI:
    app = FastAPI(
        title="Rhizome Trainer API",
        version=__version__,
        description="Submit, watch and control training jobs. Send the user id as `X-Rhizome-User`.",
        responses={
            400: {"model": ErrorBody},
            401: {"model": ErrorBody},
            404: {"model": ErrorBody},
            409: {"model": ErrorBody},
            413: {"model": ErrorBody},
            503: {"model": ErrorBody},
        },
    )
    tds = tds_pb2_grpc.TrainingDataStub(tds_channel) if tds_channel else None

    @app.exception_handler(errors.ApiError)
    async def api_error(_: Request, exc: errors.ApiError) -> JSONResponse:
        return JSONResponse({"code": exc.code, "message": exc.message}, status_code=exc.http_status)

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

    @app.middleware("http")
    async def limit_body(request: Request, call_next):  # type: ignore[no-untyped-def]
        length = request.headers.get("content-length")
        limit = MAX_MODEL_BYTES + MAX_MANIFEST_BYTES + 64 * 1024
        if length and length.isdigit() and int(length) > limit:
            return JSONResponse(
                {
                    "code": "too_large",
                    "message": f"request body is {length} bytes; at most {limit}",
                },
                status_code=413,
            )
        return await call_next(request)

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
        model_definition: UploadFile | None = File(None, description="zipped training code"),
        idempotency_key: str = Form(""),
        x_rhizome_user: str | None = Header(None),
        x_watson_userinfo: str | None = Header(None),
        idempotency_key_header: str | None = Header(None, alias="Idempotency-Key"),
    ) -> JSONResponse:
        text = await manifest.read(MAX_MANIFEST_BYTES + 1)
        if len(text) > MAX_MANIFEST_BYTES:
            raise errors.TooLarge(f"manifest is larger than {MAX_MANIFEST_BYTES} bytes")
        code = b""
        if model_definition is not None:
            code = await model_definition.read(MAX_MODEL_BYTES + 1)
        created = core.create(
            _user(x_rhizome_user, x_watson_userinfo),
            text,
            code,
            idempotency_key or idempotency_key_header or "",
        )
        body = _job_json(created.job)
        body["existing"] = created.existing
        return JSONResponse(body, status_code=200 if created.existing else 201)

    @app.get("/v1/models", tags=["models"])
    def list_models(
        status: list[str] = Query(default_factory=list),
        name_prefix: str = Query("", max_length=128),
        page_size: int = Query(50, ge=1, le=500),
        page_token: str = Query("", max_length=256),
        x_rhizome_user: str | None = Header(None),
        x_watson_userinfo: str | None = Header(None),
    ) -> dict[str, Any]:
        wanted = [s.upper() for s in status]
        unknown = [s for s in wanted if s not in states.ALL_STATES]
        if unknown:
            raise errors.BadRequest(
                f"status: unknown {', '.join(unknown)}; allowed: {', '.join(states.ALL_STATES)}"
            )
        page = core.list(
            _user(x_rhizome_user, x_watson_userinfo), wanted, name_prefix, page_size, page_token
        )
        return {
            "models": [_job_json(j) for j in page.jobs],
            "next_page_token": page.next_page_token,
        }

    @app.get("/v1/models/{model_id}", tags=["models"])
    def get_model(
        model_id: str,
        x_rhizome_user: str | None = Header(None),
        x_watson_userinfo: str | None = Header(None),
    ) -> dict[str, Any]:
        return _job_json(core.get(_user(x_rhizome_user, x_watson_userinfo), model_id))

    @app.patch("/v1/models/{model_id}", tags=["models"])
    def patch_model(
        model_id: str,
        body: PatchBody,
        x_rhizome_user: str | None = Header(None),
        x_watson_userinfo: str | None = Header(None),
    ) -> dict[str, Any]:
        user = _user(x_rhizome_user, x_watson_userinfo)
        action = body.status.lower()
        if action == "halt":
            return _job_json(core.halt(user, model_id))
        if action == "resume":
            return _job_json(core.resume(user, model_id))
        raise errors.BadRequest(f"status: {body.status!r} is not allowed; use 'halt' or 'resume'")

    @app.post("/v1/models/{model_id}/scale", tags=["models"])
    def scale_model(
        model_id: str,
        body: ScaleBody,
        x_rhizome_user: str | None = Header(None),
        x_watson_userinfo: str | None = Header(None),
    ) -> dict[str, Any]:
        return _job_json(
            core.scale(_user(x_rhizome_user, x_watson_userinfo), model_id, body.learners)
        )

    @app.delete("/v1/models/{model_id}", tags=["models"])
    def delete_model(
        model_id: str,
        x_rhizome_user: str | None = Header(None),
        x_watson_userinfo: str | None = Header(None),
    ) -> dict[str, Any]:
        return _job_json(core.delete(_user(x_rhizome_user, x_watson_userinfo), model_id))

    def _stream(
        model_id: str, user: str, method: str, request: Any, follow: bool
    ) -> StreamingResponse:
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
                yield (
                    json.dumps({"code": "unavailable", "message": str(exc.details())}) + "\n"
                ).encode()
            finally:
                call.cancel()

        return StreamingResponse(lines(), media_type="application/x-ndjson")

    @app.get("/v1/models/{model_id}/logs", tags=["models"])
    def get_logs(
        model_id: str,
        follow: bool = False,
        learner: int = Query(-1, ge=-1, le=INT32_MAX),
        search: str = Query("", max_length=1024),
        pos: int = Query(0, ge=INT64_MIN, le=INT64_MAX),
        pagesize: int = Query(0, ge=0, le=INT32_MAX),
        x_rhizome_user: str | None = Header(None),
        x_watson_userinfo: str | None = Header(None),
    ) -> StreamingResponse:
        req = tds_pb2.LogsRequest(
            job_id=model_id,
            follow=follow,
            learner=learner,
            search=search,
            pos=pos,
            page_size=pagesize,
        )
        return _stream(model_id, _user(x_rhizome_user, x_watson_userinfo), "GetLogs", req, follow)

    @app.get("/v1/models/{model_id}/metrics", tags=["models"])
    def get_metrics(
        model_id: str,
        follow: bool = False,
        learner: int = Query(-1, ge=-1, le=INT32_MAX),
        name: str = Query("", max_length=256),
        pos: int = Query(0, ge=INT64_MIN, le=INT64_MAX),
        pagesize: int = Query(0, ge=0, le=INT32_MAX),
        x_rhizome_user: str | None = Header(None),
        x_watson_userinfo: str | None = Header(None),
    ) -> StreamingResponse:
        req = tds_pb2.MetricsRequest(
            job_id=model_id, follow=follow, learner=learner, name=name, pos=pos, page_size=pagesize
        )
        return _stream(
            model_id, _user(x_rhizome_user, x_watson_userinfo), "GetMetrics", req, follow
        )

    return app
