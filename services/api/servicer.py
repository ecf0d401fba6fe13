"""The public `rhizome.v1.Trainer` gRPC service: a thin skin over TrainerCore."""

from __future__ import annotations

import functools
import io
import itertools
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from rhizome.v1 import (
    job_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    tds_pb2,
    tds_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
)

from services import __version__
from services.api import errors
from services.api.auth import Authenticator, Principal
from services.api.convert import endpoint_to_proto, job_to_proto, token_to_proto
from services.api.core import (
    HOW_TO_UPLOAD_LARGE_CODE,
    MAX_LOG_SEARCH,
    MAX_METRIC_NAME,
    MAX_MODEL_BYTES,
    MAX_UNARY_MODEL_BYTES,
    SPOOL_BYTES,
    ModelArchive,
    TrainerCore,
    bounded,
    chunks,
    too_large,
)
from services.store import states

T = TypeVar("T")

# The training data service's refusals of the caller's request (a bad argument, an
# unknown job...) reach the caller as what they are; anything else is the TDS failing.
_CALLER_ERRORS = frozenset(
    {
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


def _abort_on_api_error(fn: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(fn)
    def wrapper(self: Any, request: Any, context: grpc.ServicerContext) -> T:
        try:
            return fn(self, request, context)
        except errors.ApiError as exc:
            if trailers := exc.grpc_trailers():
                context.set_trailing_metadata(trailers)
            context.abort(exc.grpc_code, exc.message)
            raise  # unreachable: abort raises

    return wrapper


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(
        self,
        core: TrainerCore,
        tds_channel: grpc.Channel | None = None,
        scheduler_channel: grpc.Channel | None = None,
        services: list[str] | None = None,
        auth: Authenticator | None = None,
    ) -> None:
        self.core = core
        # Without an authenticator nobody gets in: no token store, no trusted header.
        self.auth = auth or Authenticator(None)
        self.tds = tds_pb2_grpc.TrainingDataStub(tds_channel) if tds_channel else None
        self.scheduler = (
            scheduler_pb2_grpc.SchedulerStub(scheduler_channel) if scheduler_channel else None
        )
        self.services = services or ["api"]

    def caller(self, context: grpc.ServicerContext) -> Principal:
        """Who is calling (errors.Unauthenticated when nobody can tell)."""
        return self.auth.from_grpc(context.invocation_metadata())

    @_abort_on_api_error
    def CreateJob(
        self, request: trainer_pb2.CreateJobRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.CreateJobResponse:
        who = self.caller(context)
        size = len(request.model_definition)
        if size > MAX_UNARY_MODEL_BYTES:
            raise too_large(
                size, MAX_UNARY_MODEL_BYTES, f"in one CreateJob message; {HOW_TO_UPLOAD_LARGE_CODE}"
            )
        created = self.core.create(
            who, request.manifest_yaml, request.model_definition, request.idempotency_key
        )
        return trainer_pb2.CreateJobResponse(
            job_id=created.job.job_id, job=job_to_proto(created.job), existing=created.existing
        )

    @_abort_on_api_error
    def CreateJobStream(
        self, request_iterator: Iterator[trainer_pb2.CreateJobChunk], context: grpc.ServicerContext
    ) -> trainer_pb2.CreateJobResponse:
        # Who is calling, and whether the manifest is good, before a byte of code is read.
        who = self.caller(context)
        first = next(request_iterator, None)
        if first is None or not first.HasField("header"):
            raise errors.BadRequest(
                "the first CreateJobStream message must carry `header` (the manifest and "
                "idempotency key); the code follows in `data`"
            )
        header = first.header
        if header.model_definition:
            raise errors.BadRequest(
                "header.model_definition must be empty in CreateJobStream; send the code in `data`"
            )
        self.core.check_idempotency_key(header.idempotency_key)
        manifest = self.core.check_manifest(header.manifest_yaml)
        # The code goes to a spooled file: memory up to SPOOL_BYTES, disk beyond. Nothing
        # is stored before the last piece arrived, so a client that goes away mid-upload
        # (the iterator raises) leaves no job, no record and no object.
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
            size = 0
            for n, chunk in enumerate(itertools.chain([first], request_iterator)):
                if n and chunk.HasField("header"):
                    raise errors.BadRequest("only the first CreateJobStream message has a header")
                size += len(chunk.data)
                if size > MAX_MODEL_BYTES:
                    raise too_large(
                        size, MAX_MODEL_BYTES, "(put data in a data store, not in the model zip)"
                    )
                spool.write(chunk.data)
            spool.seek(0)
            code: ModelArchive = spool if size else b""
            created = self.core.create(
                who, header.manifest_yaml, code, header.idempotency_key, checked=manifest
            )
        return trainer_pb2.CreateJobResponse(
            job_id=created.job.job_id, job=job_to_proto(created.job), existing=created.existing
        )

    def DownloadModelDefinition(
        self, request: trainer_pb2.GetJobRequest, context: grpc.ServicerContext
    ) -> Iterator[trainer_pb2.DataChunk]:
        try:
            data = self.core.model_definition(self.caller(context), request.job_id)
        except errors.ApiError as exc:
            context.abort(exc.grpc_code, exc.message)
        for piece in chunks(io.BytesIO(data)):
            yield trainer_pb2.DataChunk(data=piece)

    def DownloadTrainedModel(
        self, request: trainer_pb2.GetJobRequest, context: grpc.ServicerContext
    ) -> Iterator[trainer_pb2.DataChunk]:
        try:
            archive = self.core.trained_model(self.caller(context), request.job_id)
        except errors.ApiError as exc:
            context.abort(exc.grpc_code, exc.message)
        for piece in chunks(archive):
            yield trainer_pb2.DataChunk(data=piece)

    # -- events -------------------------------------------------------------------------------
    @_abort_on_api_error
    def CreateEventEndpoint(
        self, request: trainer_pb2.CreateEventEndpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.CreateEventEndpointResponse:
        record, secret = self.core.add_event_endpoint(
            self.caller(context),
            request.job_id,
            request.event_type,
            request.url,
            request.endpoint_id,
        )
        return trainer_pb2.CreateEventEndpointResponse(
            endpoint=endpoint_to_proto(record), secret=secret
        )

    @_abort_on_api_error
    def ListEventEndpoints(
        self, request: trainer_pb2.ListEventEndpointsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ListEventEndpointsResponse:
        found = self.core.event_endpoints(self.caller(context), request.job_id, request.event_type)
        return trainer_pb2.ListEventEndpointsResponse(
            endpoints=[endpoint_to_proto(e) for e in found]
        )

    @_abort_on_api_error
    def DeleteEventEndpoint(
        self, request: trainer_pb2.EventEndpointRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.EventEndpoint:
        removed = self.core.delete_event_endpoint(
            self.caller(context), request.job_id, request.event_type, request.endpoint_id
        )
        return endpoint_to_proto(removed)

    @_abort_on_api_error
    def GetJob(
        self, request: trainer_pb2.GetJobRequest, context: grpc.ServicerContext
    ) -> job_pb2.Job:
        return job_to_proto(self.core.get(self.caller(context), request.job_id))

    @_abort_on_api_error
    def ListJobs(
        self, request: trainer_pb2.ListJobsRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ListJobsResponse:
        try:
            wanted = [states.from_proto(s) for s in request.statuses]
        except ValueError as exc:
            raise errors.BadRequest(f"statuses: {exc}") from None
        page = self.core.list(
            self.caller(context), wanted, request.name_prefix, request.page_size, request.page_token
        )
        return trainer_pb2.ListJobsResponse(
            jobs=[job_to_proto(j) for j in page.jobs], next_page_token=page.next_page_token
        )

    @_abort_on_api_error
    def HaltJob(
        self, request: trainer_pb2.JobRequest, context: grpc.ServicerContext
    ) -> job_pb2.Job:
        return job_to_proto(self.core.halt(self.caller(context), request.job_id, request.reason))

    @_abort_on_api_error
    def ResumeJob(
        self, request: trainer_pb2.JobRequest, context: grpc.ServicerContext
    ) -> job_pb2.Job:
        return job_to_proto(self.core.resume(self.caller(context), request.job_id, request.reason))

    @_abort_on_api_error
    def DeleteJob(
        self, request: trainer_pb2.JobRequest, context: grpc.ServicerContext
    ) -> job_pb2.Job:
        return job_to_proto(self.core.delete(self.caller(context), request.job_id, request.reason))

    @_abort_on_api_error
    def ScaleJob(
        self, request: trainer_pb2.ScaleJobRequest, context: grpc.ServicerContext
    ) -> job_pb2.Job:
        return job_to_proto(self.core.scale(self.caller(context), request.job_id, request.learners))

    def StreamLogs(
        self, request: tds_pb2.LogsRequest, context: grpc.ServicerContext
    ) -> Iterator[tds_pb2.LogLine]:
        yield from self._proxy_stream(request, context, "GetLogs")

    def StreamMetrics(
        self, request: tds_pb2.MetricsRequest, context: grpc.ServicerContext
    ) -> Iterator[tds_pb2.MetricSample]:
        yield from self._proxy_stream(request, context, "GetMetrics")

    def _proxy_stream(
        self, request: Any, context: grpc.ServicerContext, method: str
    ) -> Iterator[Any]:
        try:
            self.core.get(self.caller(context), request.job_id)  # ownership check, clear 404
            if isinstance(request, tds_pb2.LogsRequest):
                bounded("search", request.search, MAX_LOG_SEARCH)
            else:
                bounded("name", request.name, MAX_METRIC_NAME)
            if self.tds is None:
                raise errors.Unavailable("the training data service (tds) is not configured")
        except errors.ApiError as exc:
            context.abort(exc.grpc_code, exc.message)
        assert self.tds is not None
        upstream = getattr(self.tds, method)(request)
        context.add_callback(upstream.cancel)
        try:
            yield from upstream
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and not context.is_active():
                return
            if exc.code() in _CALLER_ERRORS:
                context.abort(exc.code(), str(exc.details()))
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the training data service failed: {exc.details()}"
            )

    @_abort_on_api_error
    def GetCluster(
        self, request: scheduler_pb2.GetClusterRequest, context: grpc.ServicerContext
    ) -> scheduler_pb2.ClusterView:
        self.caller(context)
        if self.scheduler is None:
            counts = self.core.jobs.count_by_status()
            return scheduler_pb2.ClusterView(
                queued_jobs=counts.get(states.QUEUED, 0),
                running_jobs=sum(counts.get(s, 0) for s in states.ACTIVE_STATES),
            )
        try:
            view: scheduler_pb2.ClusterView = self.scheduler.GetCluster(request, timeout=10)
        except grpc.RpcError as exc:
            context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the scheduler is unavailable: {exc.details()}"
            )
        return view

    def GetVersion(
        self, request: trainer_pb2.GetVersionRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.VersionInfo:
        # Public, like health and reflection: a client checks what it talks to before
        # it has a token.
        return trainer_pb2.VersionInfo(
            version=__version__, api="rhizome.v1", services=self.services
        )

    # -- tokens (admins only) -------------------------------------------------------------------
    @_abort_on_api_error
    def CreateToken(
        self, request: trainer_pb2.CreateTokenRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.CreateTokenResponse:
        record, secret = self.auth.create_token(
            self.caller(context),
            request.user,
            request.role,
            request.expires_in_seconds,
            request.description,
        )
        return trainer_pb2.CreateTokenResponse(token=token_to_proto(record), secret=secret)

    @_abort_on_api_error
    def ListTokens(
        self, request: trainer_pb2.ListTokensRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.ListTokensResponse:
        tokens = self.auth.list_tokens(self.caller(context))
        return trainer_pb2.ListTokensResponse(tokens=[token_to_proto(t) for t in tokens])

    @_abort_on_api_error
    def RevokeToken(
        self, request: trainer_pb2.RevokeTokenRequest, context: grpc.ServicerContext
    ) -> trainer_pb2.Token:
        return token_to_proto(self.auth.revoke_token(self.caller(context), request.token_id))
