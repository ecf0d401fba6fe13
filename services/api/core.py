"""What the Trainer API does, independent of the wire: both the gRPC servicer and the
REST gateway call this, so the two doors behave the same."""

from __future__ import annotations

import io
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Protocol

import pymongo.errors

from services.api import errors
from services.api.archive import check_archive
from services.api.auth import Principal, as_principal
from services.api.shedding import SubmitGate
from services.events import api as events_api
from services.events.api import EndpointRecord, EventEndpoints
from services.manifest import Manifest, ManifestError, parse_manifest
from services.objectstore.api import ObjectNotFound, ObjectStore, ObjectStoreError, result_prefix
from services.objectstore.api import model_key as model_key_of
from services.store import states
from services.store.errors import IdempotencyConflict, JobNotFound, StoreUnavailable
from services.store.jobs import JobRecord, JobsRepository, Page, new_job_id

# A code archive may be this large when it is streamed (CreateJobStream, REST multipart);
# in one CreateJob message at most MAX_UNARY_MODEL_BYTES, below the daemon's gRPC message
# limit (80 MiB) so that the refusal is ours, naming the limit and the way round it.
MAX_MODEL_BYTES = 512 * 1024 * 1024
MAX_UNARY_MODEL_BYTES = 64 * 1024 * 1024
# Uploads and downloads are held in memory up to this size, on disk beyond it.
SPOOL_BYTES = 8 * 1024 * 1024
CHUNK_BYTES = 1024 * 1024
HOW_TO_UPLOAD_LARGE_CODE = (
    "upload larger code with the streaming call CreateJobStream (the SDK and `rhizome "
    "train` use it by themselves) or as multipart `model_definition` on POST /v1/models"
)
MAX_IDEMPOTENCY_KEY = 128
# Every free-text field a caller sends is bounded here, behind both doors (the REST
# gateway's query parameters carry the same bounds). A halt, resume or delete reason is
# kept in the job's history: unbounded, four 2 MB reasons made a job larger than
# MongoDB's 16 MB document limit, and no halt, resume or delete of it could be stored.
MAX_JOB_ID = 128
MAX_REASON = 1024
MAX_NAME_PREFIX = 128
MAX_PAGE_TOKEN = 256
MAX_LOG_SEARCH = 1024
MAX_METRIC_NAME = 256


def bounded(field: str, value: str, limit: int) -> str:
    if len(value) > limit:
        raise errors.BadRequest(f"{field} is {len(value)} characters; at most {limit}")
    return value


# job -> (admitted, reason): the scheduler refuses at submit what can never fit the cluster.
AdmitFn = Callable[[JobRecord], tuple[bool, str]]


class Lifecycle(Protocol):
    """The lifecycle manager as the API sees it: halt, resume, delete and scale of deployed
    jobs, one typed call each. Each returns the LCM's message, and raises an ApiError when
    the LCM refuses (errors.Conflict, with its reason) or cannot be reached
    (errors.Unavailable)."""

    def halt(self, job_id: str, reason: str) -> str: ...

    def resume(self, job_id: str, reason: str) -> str: ...

    def delete(self, job_id: str, reason: str) -> str: ...

    def scale(self, job_id: str, learners: int, reason: str) -> str: ...


class ScaleGangs(Protocol):
    """The scheduler as a scale-out sees it: the learners added to a running elastic job
    are a gang of their own, placed now under the job owner's quota, or refused."""

    def place(self, job: JobRecord, gang_id: str, learners: int) -> list[str]:
        """The nodes of the placed gang (one per learner), or errors.Conflict saying why
        the scheduler cannot place it now; a refused gang is not left queued."""
        ...

    def release(self, gang_id: str) -> None: ...


@dataclass
class Created:
    job: JobRecord
    existing: bool


# The code archive as the API receives it: the bytes of one message, or a spooled file
# (a streamed or multipart upload) positioned at its start.
ModelArchive = bytes | IO[bytes]


def archive_size(model: ModelArchive) -> int:
    if isinstance(model, bytes):
        return len(model)
    here = model.tell()
    size = model.seek(0, io.SEEK_END) - here
    model.seek(here)
    return size


def too_large(size: int, limit: int, how: str) -> errors.TooLarge:
    return errors.TooLarge(
        f"model definition is {size} bytes; at most {limit} ({limit // 2**20} MiB) {how}"
    )


class TrainerCore:
    def __init__(
        self,
        jobs: JobsRepository,
        objects: ObjectStore,
        admit: AdmitFn | None = None,
        lifecycle: Lifecycle | None = None,
        gate: SubmitGate | None = None,
    ) -> None:
        self.jobs = jobs
        self.gate = gate or SubmitGate()
        self.objects = objects
        self.admit = admit
        self.lifecycle = lifecycle
        # Called after a new job is stored (the daemon hands it to the scheduler).
        self.on_stored: Callable[[JobRecord], None] | None = None
        # Called once a job is deleted (the daemon asks the TDS to drop its logs and
        # metrics after their retention).
        self.on_deleted: Callable[[str], None] | None = None
        # Webhook registrations (services/events); None: this daemon offers no events.
        self.events: EventEndpoints | None = None
        # The scheduler's side of a running elastic job's scale-out (None: no scheduler,
        # the added learners run on the job's own nodes).
        self.scale_gangs: ScaleGangs | None = None

    # -- submit ---------------------------------------------------------------------------
    def create(
        self,
        who: Principal | str,
        manifest_text: str | bytes,
        model_zip: ModelArchive = b"",
        idempotency_key: str = "",
        checked: Manifest | None = None,
    ) -> Created:
        """Store a new job; refused with Overloaded (nothing stored) when the API already
        has its limit of submits in flight (services/api/shedding.py). `checked`: the
        manifest as `check_manifest` parsed this very text already (a streamed upload
        checks it before it reads the code), so that it is not parsed twice."""
        with self.gate.slot():
            return self._create(who, manifest_text, model_zip, idempotency_key, checked)

    def _create(
        self,
        who: Principal | str,
        manifest_text: str | bytes,
        model_zip: ModelArchive,
        idempotency_key: str,
        checked: Manifest | None,
    ) -> Created:
        owner = as_principal(who).user  # an admin's submit is the admin's own job
        self.check_idempotency_key(idempotency_key)
        size = archive_size(model_zip)
        if size > MAX_MODEL_BYTES:
            raise too_large(
                size, MAX_MODEL_BYTES, "(put data in a data store, not in the model zip)"
            )
        manifest = checked or self.check_manifest(manifest_text)
        if size:
            start = 0 if isinstance(model_zip, bytes) else model_zip.tell()
            check_archive(model_zip)
            if not isinstance(model_zip, bytes):
                model_zip.seek(start)
        # A retried key is caught by the unique index on insert (JobsRepository.create),
        # which saves every first submit a lookup.
        job_id = new_job_id()
        record = JobRecord.for_manifest(job_id, owner, manifest, idempotency_key=idempotency_key)
        if self.admit is not None:
            admitted, reason = self.admit(record)
            if not admitted:
                raise errors.BadRequest(f"job cannot be scheduled: {reason}")
        model_key = ""
        if size:
            # The code is stored before the record, so an acknowledged job always has it.
            model_key = record.model_path = model_key_of(job_id)
            try:
                if isinstance(model_zip, bytes):
                    self.objects.put(model_key, model_zip)
                else:
                    self.objects.put_file(model_key, model_zip)
            except ObjectStoreError as exc:
                raise errors.Unavailable(
                    f"the object store is unavailable, nothing was stored: {exc}"
                ) from None
        try:
            stored, existing_flag = self.jobs.create(record)
        except IdempotencyConflict as exc:
            if model_key:
                self.objects.delete(model_key)
            raise errors.Conflict(str(exc)) from None
        except (pymongo.errors.PyMongoError, StoreUnavailable) as exc:
            if model_key:
                self.objects.delete(model_key)
            raise errors.Unavailable(
                f"the job store is unavailable, nothing was stored: {exc}"
            ) from None
        if existing_flag and model_key:
            self.objects.delete(model_key)
        if not existing_flag and self.on_stored is not None:
            self.on_stored(stored)
        return Created(stored, existing_flag)

    @staticmethod
    def check_idempotency_key(key: str) -> None:
        if len(key) > MAX_IDEMPOTENCY_KEY:
            raise errors.BadRequest(f"idempotency key longer than {MAX_IDEMPOTENCY_KEY} characters")

    @staticmethod
    def check_manifest(manifest_text: str | bytes) -> Manifest:
        """The parsed manifest, or BadRequest naming what is wrong: a streamed upload
        runs this before it reads the code, so a bad manifest costs no upload."""
        try:
            return parse_manifest(manifest_text)
        except ManifestError as exc:
            raise errors.BadRequest(f"bad manifest: {exc}") from None

    # -- downloads (FfDL's /definition and /trained_model) ----------------------------------
    def model_definition(self, who: Principal | str, job_id: str) -> bytes:
        """The code archive the job was submitted with; NotFound when it had none."""
        job = self.get(who, job_id)
        if not job.model_path:
            raise errors.NotFound(f"job {job_id} was submitted without a model definition")
        try:
            return self.objects.get(job.model_path)
        except ObjectNotFound:
            raise errors.NotFound(
                f"job {job_id}'s model definition is no longer in the object store"
            ) from None
        except ObjectStoreError as exc:
            raise errors.Unavailable(f"the object store is unavailable: {exc}") from None

    def trained_model(self, who: Principal | str, job_id: str) -> IO[bytes]:
        """A zip of what the job's learners wrote to their results location
        (`results/<job>/<rank>/...` in the object store, `<rank>/...` in the zip), spooled
        to disk beyond SPOOL_BYTES; NotFound while there is nothing yet."""
        job = self.get(who, job_id)
        prefix = result_prefix(job.job_id)
        try:
            keys = self.objects.list_keys(prefix)
        except ObjectStoreError as exc:
            raise errors.Unavailable(f"the object store is unavailable: {exc}") from None
        if not keys:
            raise errors.NotFound(
                f"job {job_id} ({job.status}) has no trained model yet: its learners store "
                "what they write to $RHIZOME_RESULT_DIR when their command succeeds"
            )
        spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES)  # noqa: SIM115
        try:
            with zipfile.ZipFile(spool, "w", zipfile.ZIP_DEFLATED) as zf:
                for key in keys:
                    zf.writestr(key[len(prefix) + 1 :], self.objects.get(key))
        except ObjectStoreError as exc:
            spool.close()
            raise errors.Unavailable(f"the object store is unavailable: {exc}") from None
        spool.seek(0)
        return spool

    # -- events (FfDL's /v1/models/{id}/events/{event_type}) ----------------------------------
    def add_event_endpoint(
        self, who: Principal | str, job_id: str, event_type: str, url: str, endpoint_id: str = ""
    ) -> tuple[EndpointRecord, str]:
        """Register a webhook for the job's `event_type`; returns it and its signing
        secret, which no later call returns. Only the job's owner (or an admin) may."""
        events = self._events()
        job = self.get(who, job_id)
        try:
            record = EndpointRecord(
                endpoint_id=(
                    events_api.check_endpoint_id(endpoint_id)
                    if endpoint_id
                    else events_api.new_endpoint_id()
                ),
                job_id=job.job_id,
                owner=job.owner,
                event_type=events_api.check_event_type(event_type),
                url=events_api.check_url(url),
                secret=events_api.new_secret(),
                created_at=time.time(),
                # Only what happens from now on is delivered.
                delivered=len(job.history),
            )
            self._wrap(events.create, record)
        except events_api.BadEndpoint as exc:
            raise errors.BadRequest(str(exc)) from None
        except (events_api.EndpointExists, events_api.TooManyEndpoints) as exc:
            raise errors.Conflict(str(exc)) from None
        return record, record.secret

    def event_endpoints(
        self, who: Principal | str, job_id: str, event_type: str = ""
    ) -> list[EndpointRecord]:
        events = self._events()
        job = self.get(who, job_id)
        try:
            wanted = events_api.check_event_type(event_type) if event_type else ""
        except events_api.BadEndpoint as exc:
            raise errors.BadRequest(str(exc)) from None
        found: list[EndpointRecord] = self._wrap(events.for_job, job.job_id, wanted)
        return found

    def delete_event_endpoint(
        self, who: Principal | str, job_id: str, event_type: str, endpoint_id: str
    ) -> EndpointRecord:
        events = self._events()
        job = self.get(who, job_id)
        try:
            wanted = events_api.check_event_type(event_type)
            removed: EndpointRecord = self._wrap(events.delete, job.job_id, wanted, endpoint_id)
        except events_api.BadEndpoint as exc:
            raise errors.BadRequest(str(exc)) from None
        except events_api.EndpointNotFound as exc:
            raise errors.NotFound(str(exc)) from None
        return removed

    def _events(self) -> EventEndpoints:
        if self.events is None:
            raise errors.Unimplemented("this daemon offers no job events (no event store)")
        return self.events

    # -- read -------------------------------------------------------------------------------
    # A user sees and controls only their own jobs (another owner's job is a 404, as if it
    # did not exist); an admin sees and controls every job.
    def get(self, who: Principal | str, job_id: str) -> JobRecord:
        bounded("job_id", job_id, MAX_JOB_ID)
        try:
            return self._wrap(self.jobs.get, job_id, owner_scope(who))
        except JobNotFound as exc:
            raise errors.NotFound(str(exc)) from None

    def list(
        self,
        who: Principal | str,
        statuses: list[str],
        name_prefix: str,
        page_size: int,
        page_token: str,
    ) -> Page:
        scope = owner_scope(who)
        bounded("name_prefix", name_prefix, MAX_NAME_PREFIX)
        bounded("page_token", page_token, MAX_PAGE_TOKEN)
        if page_size < 0:
            raise errors.BadRequest("page_size must be positive (at most 500)")
        return self._wrap(self.jobs.list_page, scope, statuses, name_prefix, page_size, page_token)

    # -- change -------------------------------------------------------------------------------
    def halt(self, owner: Principal | str, job_id: str, reason: str = "") -> JobRecord:
        return self._control(
            owner, job_id, lambda lc: lc.halt, states.HALTED, reason or "halted by user"
        )

    def resume(self, owner: Principal | str, job_id: str, reason: str = "") -> JobRecord:
        bounded("reason", reason, MAX_REASON)
        job = self.get(owner, job_id)
        if job.status != states.HALTED:
            raise errors.Conflict(f"job {job_id} is {job.status}; only a HALTED job can be resumed")
        if self.lifecycle is not None:
            # The LCM clears the job's keys and queues it again.
            self.lifecycle.resume(job_id, reason or "resumed by user")
            resumed = self.get(owner, job_id)
        else:
            resumed = self._transition(job_id, states.QUEUED, reason or "resumed by user")
        if self.on_stored is not None and resumed.status == states.QUEUED:
            self.on_stored(resumed)  # the scheduler places it now rather than at its resync
        return resumed

    def delete(self, owner: Principal | str, job_id: str, reason: str = "") -> JobRecord:
        job = self._control(
            owner, job_id, lambda lc: lc.delete, states.DELETED, reason or "deleted by user"
        )
        if self.on_deleted is not None:
            self.on_deleted(job_id)
        return job

    def scale(self, owner: Principal | str, job_id: str, learners: int) -> JobRecord:
        job = self.get(owner, job_id)
        elastic = job.spec.elastic
        if elastic is None:
            raise errors.Conflict(
                f"job {job_id} is not elastic; add `elastic: {{min: M, max: N}}` to its manifest"
            )
        lo, hi = elastic.min, elastic.max
        if not lo <= learners <= hi:
            raise errors.BadRequest(
                f"learners={learners} is outside the job's elastic bounds [{lo}, {hi}]"
            )
        if self.lifecycle is None or job.status in (states.QUEUED, states.HALTED):
            # nothing runs: the next deploy starts this many
            resources = dict(job.resources, learners=learners)
            return self._wrap(lambda: self.jobs.update_fields(job_id, resources=resources))
        if job.status not in (states.PROCESSING, states.RESCALING):
            raise errors.Conflict(
                f"job {job_id} is {job.status}: a running elastic job is scaled while it is "
                "PROCESSING (a queued or halted one changes its size for its next deploy); "
                f"wait until `rhizome show {job_id}` says PROCESSING and try again"
            )
        reason = f"scaled to {learners} learners by {as_principal(owner).user}"
        current = int(job.resources["learners"])
        if learners > current and self.scale_gangs is not None:
            self._place_scale_gang(job, learners - current, learners)
        self.lifecycle.scale(job_id, learners, reason)
        return self.get(owner, job_id)

    def _place_scale_gang(self, job: JobRecord, added: int, target: int) -> None:
        """The learners a scale-out adds, as a gang of their own: listed in the job's
        record before the scheduler places it (the scheduler releases a gang its job does
        not list), and the nodes written once it is placed; the guardian deploys onto them.
        Raises errors.Conflict when the scheduler cannot place it now."""
        assert self.scale_gangs is not None
        from services.scheduler.api import scale_gang_id

        gang = scale_gang_id(job.job_id, job.version)
        field = f"placement.scale_gangs.{gang}"
        entry = {"learners": added, "target": target, "state": "requested", "nodes": []}
        if not job.placement:  # a field path cannot be created inside a null placement
            self._wrap(lambda: self.jobs.update_fields(job.job_id, placement={}))
        self._wrap(lambda: self.jobs.update_fields(job.job_id, **{field: entry}))
        try:
            nodes = self.scale_gangs.place(job, gang, added)
        except errors.ApiError:
            self._wrap(lambda: self.jobs.update_fields(job.job_id, **{field: None}))
            raise
        placed = {**entry, "nodes": nodes}
        self._wrap(lambda: self.jobs.update_fields(job.job_id, **{field: placed}))

    def _control(
        self,
        owner: Principal | str,
        job_id: str,
        # Picks the port's bound method (`lambda lc: lc.halt`). Not `Lifecycle.halt`: that
        # is the Protocol's own empty method, which would forward nothing.
        forward: Callable[[Lifecycle], Callable[[str, str], str]],
        target: str,
        reason: str,
    ) -> JobRecord:
        bounded("reason", reason, MAX_REASON)
        job = self.get(owner, job_id)
        if job.status == target:
            return job  # a retried halt/delete is a no-op, not an error
        if job.status in (states.QUEUED, states.HALTED) or self.lifecycle is None:
            # Nothing is deployed (or no lifecycle manager runs): the API moves the record itself.
            return self._transition(job_id, target, reason)
        if not states.is_legal(job.status, target):
            raise errors.Conflict(str(states.IllegalTransition(job_id, job.status, target)))
        forward(self.lifecycle)(job_id, reason)
        return self.get(owner, job_id)

    def _transition(self, job_id: str, target: str, reason: str) -> JobRecord:
        try:
            return self._wrap(self.jobs.transition, job_id, target, reason)
        except states.IllegalTransition as exc:
            raise errors.Conflict(str(exc)) from None

    @staticmethod
    def _wrap(fn, *args):  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except (pymongo.errors.PyMongoError, StoreUnavailable) as exc:
            raise errors.Unavailable(f"the job store is unavailable: {exc}") from None


def owner_scope(who: Principal | str) -> str | None:
    """The owner a caller's reads and changes are limited to; None (every job) for an admin."""
    principal = as_principal(who)
    return None if principal.is_admin else principal.user


def chunks(file: IO[bytes], size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The file's bytes in pieces of `size`; closes it at the end (or when abandoned)."""
    with file:
        while piece := file.read(size):
            yield piece
