"""What the Trainer API does, independent of the wire: both the gRPC servicer and the
REST gateway call this, so the two doors behave the same."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import pymongo.errors

from services.api import errors
from services.api.archive import check_archive
from services.api.auth import Principal, as_principal
from services.manifest import ManifestError, parse_manifest
from services.objectstore.api import ObjectStore, ObjectStoreError
from services.objectstore.api import model_key as model_key_of
from services.store import states
from services.store.errors import IdempotencyConflict, JobNotFound, StoreUnavailable
from services.store.jobs import JobRecord, JobsRepository, Page, new_job_id

MAX_MODEL_BYTES = 64 * 1024 * 1024
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


class TrainerCore:
    def __init__(
        self,
        jobs: JobsRepository,
        objects: ObjectStore,
        admit: AdmitFn | None = None,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self.jobs = jobs
        self.objects = objects
        self.admit = admit
        self.lifecycle = lifecycle
        # Called after a new job is stored (the daemon hands it to the scheduler).
        self.on_stored: Callable[[JobRecord], None] | None = None
        # Called once a job is deleted (the daemon asks the TDS to drop its logs and
        # metrics after their retention).
        self.on_deleted: Callable[[str], None] | None = None
        # The scheduler's side of a running elastic job's scale-out (None: no scheduler,
        # the added learners run on the job's own nodes).
        self.scale_gangs: ScaleGangs | None = None

    # -- submit ---------------------------------------------------------------------------
    def create(
        self,
        who: Principal | str,
        manifest_text: str | bytes,
        model_zip: bytes = b"",
        idempotency_key: str = "",
    ) -> Created:
        owner = as_principal(who).user  # an admin's submit is the admin's own job
        if len(idempotency_key) > MAX_IDEMPOTENCY_KEY:
            raise errors.BadRequest(f"idempotency key longer than {MAX_IDEMPOTENCY_KEY} characters")
        if len(model_zip) > MAX_MODEL_BYTES:
            raise errors.TooLarge(
                f"model definition is {len(model_zip)} bytes; at most {MAX_MODEL_BYTES} "
                "(put data in a data store, not in the model zip)"
            )
        try:
            manifest = parse_manifest(manifest_text)
        except ManifestError as exc:
            raise errors.BadRequest(f"bad manifest: {exc}") from None
        if model_zip:
            check_archive(model_zip)
        # A retried key is caught by the unique index on insert (JobsRepository.create),
        # which saves every first submit a lookup.
        job_id = new_job_id()
        record = JobRecord.for_manifest(job_id, owner, manifest, idempotency_key=idempotency_key)
        if self.admit is not None:
            admitted, reason = self.admit(record)
            if not admitted:
                raise errors.BadRequest(f"job cannot be scheduled: {reason}")
        model_key = ""
        if model_zip:
            # The code is stored before the record, so an acknowledged job always has it.
            model_key = record.model_path = model_key_of(job_id)
            try:
                self.objects.put(model_key, model_zip)
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
