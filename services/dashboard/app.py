"""The dashboard's routes, mounted on the REST gateway (same process, same port).

Pages are rendered on the server (Jinja2) and made live by small scripts in `static/`:
the jobs list and a job's status are polled as JSON under `/ui/`, a job's logs and metrics
arrive as server-sent events proxied from the training data service's follow streams.
Every page and `/ui/` call needs a session (a cookie from the login page); everything a
page does goes through the same `TrainerCore` as the API, with the signed-in user's
principal, so the dashboard can never see or do more than that user's token can.
"""

from __future__ import annotations

import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlencode

import anyio
import grpc
import pymongo.errors
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from google.protobuf import json_format
from jinja2 import Environment, FileSystemLoader, select_autoescape
from rhizome.v1 import scheduler_pb2, scheduler_pb2_grpc, tds_pb2, tds_pb2_grpc
from starlette.concurrency import run_in_threadpool
from starlette.responses import StreamingResponse

from services import __version__
from services.api import errors
from services.api.auth import Authenticator, Principal, bearer
from services.api.core import (
    MAX_LOG_SEARCH,
    MAX_MODEL_BYTES,
    MAX_NAME_PREFIX,
    MAX_PAGE_TOKEN,
    TrainerCore,
    owner_scope,
)
from services.client.cost import estimate_to_finish, steps_done
from services.dashboard.api import CsrfRejected, NotSignedIn, Session
from services.dashboard.estimate import DEFAULT_RUNS, EstimateRefused, bundled_traces, estimate
from services.dashboard.sessions import CookieSessionStore
from services.dashboard.submit import examples, manifest_problem
from services.dashboard.views import job_view, with_cost, with_zones
from services.manifest import MAX_MANIFEST_BYTES
from services.scheduler.api import QuotaConfigError
from services.scheduler.quota import load_quota_config
from services.store import states
from services.store.errors import StoreUnavailable
from services.store.jobs import JobRecord

R = TypeVar("R", bound=Response)
HERE = Path(__file__).parent
SESSION_COOKIE = "rz_session"
LOGIN_CSRF_COOKIE = "rz_login_csrf"
CSRF_HEADER = "X-CSRF-Token"
PAGE_SIZE = 50
LOGIN_LINK_TTL_S = 600.0
MAX_TOKEN_CHARS = 512
# The paths the dashboard answers; the gateway's bearer check leaves them to the session
# check here (see is_dashboard_path).
PREFIXES = ("/login", "/logout", "/jobs/", "/submit", "/cluster", "/estimate", "/assets/", "/ui/")
QUEUE_SHOWN = 200
ZONES_TTL_S = 10.0
# How many jobs' estimates to finish the dashboard keeps (one simulation each).
MAX_ESTIMATES = 256
# What a page may load: only this origin's files, no inline script, no framing.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)
ESTIMATE_EXAMPLE = """name: gpt2-small
instance_type: p3.2xlarge
framework: {command: python train.py}
pipeline: {stages: 2, pipelines: 2, redundancy: eager-frc-lazy-brc}
estimate: {steps: 500, step_time: 2s, save_time: 10s, backup_time: 20s,
           alloc_time: 30-60, prep_time: 30-60, samples_per_step: 64}
"""
WHY = {
    "expired": "Your session expired. Please sign in again.",
    "signedout": "You are signed out.",
    "signin": "Please sign in to see this page.",
    "revoked": "This session was signed out. Please sign in again.",
    "invalid": "Your session is not valid here any more (the dashboard's key changed, or "
    "the cookie was altered). Please sign in again.",
}
# Which login message a NotSignedIn reason gets (sessions.py's words).
WHY_FROM = {"expired": "expired", "revoked": "signed out", "invalid": "not valid here"}


def is_dashboard_path(path: str) -> bool:
    return path == "/" or path.startswith(PREFIXES)


class _Templates:
    def __init__(self) -> None:
        self.env = Environment(
            loader=FileSystemLoader(HERE / "templates"),
            autoescape=select_autoescape(["html"]),
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.globals["version"] = __version__

    def page(self, template: str, code: int = 200, /, **context: Any) -> HTMLResponse:
        response = HTMLResponse(self.env.get_template(template).render(**context), status_code=code)
        return secure_headers(response)


def secure_headers(response: R) -> R:
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    # A login link's code must not leak to another site through the Referer header.
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-store"
    return response


def _safe_next(target: str) -> str:
    """Only a path on this site: never an open redirect to another host."""
    if target.startswith("/") and not target.startswith("//") and "\\" not in target:
        return target
    return "/"


def mount(
    app: FastAPI,
    core: TrainerCore,
    tds_channel: grpc.Channel | None,
    auth: Authenticator,
    scheduler_channel: grpc.Channel | None = None,
    state_dir: Path | None = None,
    quota_config: str = "",
) -> CookieSessionStore:
    """Add the dashboard's pages, its `/ui/` JSON and event routes and its static files to
    the gateway's app; returns the session store (tests and the login-link route use it).
    Without a scheduler channel the Cluster page shows the queue but not the nodes.
    `state_dir` keeps the sessions' key and sign-outs (sessions.py), so sessions survive a
    restart; without it they end with the process. `quota_config`: the scheduler's
    `--quota-config` file, read for the Cluster page's quotas."""
    sessions = CookieSessionStore(state_dir)
    templates = _Templates()
    tds = tds_pb2_grpc.TrainingDataStub(tds_channel) if tds_channel is not None else None
    scheduler = (
        scheduler_pb2_grpc.SchedulerStub(scheduler_channel)
        if scheduler_channel is not None
        else None
    )
    app.mount("/assets", StaticFiles(directory=HERE / "static"), name="dashboard-assets")

    def cookie_secure(request: Request) -> bool:
        return request.url.scheme == "https"

    def resolve(secret: str) -> Principal:
        """Who holds `secret`: NotSignedIn (with the API's reason) when it does not work."""
        try:
            return auth.resolve(f"Bearer {secret}")
        except errors.Unauthenticated as exc:
            raise NotSignedIn(exc.message) from None

    async def signed_in(request: Request) -> tuple[Session, Principal]:
        session = sessions.get(request.cookies.get(SESSION_COOKIE, ""))
        principal = await run_in_threadpool(resolve, session.secret)
        return session, principal

    def check_csrf(session: Session, sent: str) -> None:
        if not sent or not hmac.compare_digest(sent.encode(), session.csrf.encode()):
            raise CsrfRejected(
                "this request did not carry the page's CSRF token; reload the page and try again"
            )

    @app.exception_handler(NotSignedIn)
    async def not_signed_in(request: Request, exc: NotSignedIn) -> Response:
        if request.url.path.startswith("/ui/"):
            return JSONResponse({"code": "unauthenticated", "message": str(exc)}, status_code=401)
        said = str(exc)
        why = next((k for k, words in WHY_FROM.items() if words in said), "signin")
        query = urlencode({"why": why, "next": request.url.path})
        response = RedirectResponse(f"/login?{query}", status_code=303)
        if request.cookies.get(SESSION_COOKIE):
            response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    @app.exception_handler(CsrfRejected)
    async def csrf_rejected(request: Request, exc: CsrfRejected) -> Response:
        if request.url.path.startswith("/ui/"):
            return JSONResponse({"code": "permission_denied", "message": str(exc)}, status_code=403)
        return templates.page("error.html", 403, title="Refused", message=str(exc), who=None)

    # -- signing in and out -----------------------------------------------------------------
    def login_page(
        request: Request, message: str = "", status: int = 200, next_path: str = "/"
    ) -> Response:
        csrf = request.cookies.get(LOGIN_CSRF_COOKIE) or secrets.token_urlsafe(32)
        response = templates.page(
            "login.html", status, message=message, csrf=csrf, next=_safe_next(next_path), who=None
        )
        # Double-submit cookie: a cross-site form cannot read it, so cannot sign a victim
        # in as the attacker.
        response.set_cookie(
            LOGIN_CSRF_COOKIE,
            csrf,
            httponly=True,
            samesite="strict",
            secure=cookie_secure(request),
            path="/login",
        )
        return response

    def start_session(request: Request, secret: str, next_path: str) -> Response:
        session = sessions.create(secret)
        response = RedirectResponse(_safe_next(next_path), status_code=303)
        response.set_cookie(
            SESSION_COOKIE,
            session.session_id,
            max_age=int(sessions.max_age_s),
            httponly=True,
            samesite="strict",
            secure=cookie_secure(request),
            path="/",
        )
        response.delete_cookie(LOGIN_CSRF_COOKIE, path="/login")
        return response

    @app.get("/login", include_in_schema=False)
    def login_form(request: Request, why: str = "", next: str = "/") -> Response:
        return login_page(request, WHY.get(why, ""), next_path=next)

    @app.post("/login", include_in_schema=False)
    def login(
        request: Request,
        token: str = Form(""),
        csrf: str = Form(""),
        next: str = Form("/"),
    ) -> Response:
        expected = request.cookies.get(LOGIN_CSRF_COOKIE, "")
        if not expected or not hmac.compare_digest(expected.encode(), csrf.encode()):
            return login_page(
                request,
                "The sign-in form had expired. Please enter your token again.",
                400,
                next,
            )
        token = token.strip()
        if not token:
            return login_page(request, "Enter a token (it starts with rz_).", 400, next)
        if len(token) > MAX_TOKEN_CHARS:
            return login_page(
                request, f"That token is longer than {MAX_TOKEN_CHARS} characters.", 400, next
            )
        try:
            resolve(token)
        except NotSignedIn as exc:
            return login_page(request, f"That token was refused: {exc}", 401, next)
        except errors.ApiError as exc:
            return login_page(request, exc.message, exc.http_status, next)
        return start_session(request, token, next)

    @app.get("/login/once/{code}", include_in_schema=False)
    def login_link(code: str) -> Response:
        # A page with a button, not a sign-in on GET: a link scanner or a prefetch that
        # follows the link does not use up the code.
        return templates.page("login_once.html", code=code, who=None)

    @app.post("/login/once", include_in_schema=False)
    def login_with_link(request: Request, code: str = Form("")) -> Response:
        try:
            secret = sessions.redeem_login_code(code)
            resolve(secret)
        except NotSignedIn as exc:
            return login_page(request, str(exc), 401)
        return start_session(request, secret, "/")

    @app.post("/ui/login-links", include_in_schema=False)
    def create_login_link(request: Request) -> JSONResponse:
        """An admin (bearer token) asks for a one-time link that signs a browser in with
        the same token: what `rhizome up --embedded` prints for the local admin."""
        try:
            who = auth.from_http(request.headers)
        except errors.ApiError as exc:
            return JSONResponse({"code": exc.code, "message": exc.message}, exc.http_status)
        if not who.is_admin:
            return JSONResponse(
                {
                    "code": "permission_denied",
                    "message": "only an admin token can make login links",
                },
                403,
            )
        secret = bearer(request.headers.get("authorization", ""))
        code = sessions.issue_login_code(secret, LOGIN_LINK_TTL_S)
        return JSONResponse({"path": f"/login/once/{code}", "expires_in_s": LOGIN_LINK_TTL_S}, 201)

    @app.post("/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        session, _ = await signed_in(request)
        form = await request.form()
        check_csrf(session, str(form.get("csrf", "")))
        sessions.drop(session.session_id)
        response = RedirectResponse("/login?why=signedout", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/")
        return response

    # -- jobs -----------------------------------------------------------------------------
    def list_jobs(who: Principal, status: str, name: str, page: str) -> dict[str, Any]:
        wanted = [status.upper()] if status else []
        bad = [s for s in wanted if s not in states.ALL_STATES]
        if bad:
            raise errors.BadRequest(
                f"status {bad[0]!r} is not a job status; use one of {', '.join(states.ALL_STATES)}"
            )
        found = core.list(who, wanted, name[:MAX_NAME_PREFIX], PAGE_SIZE, page[:MAX_PAGE_TOKEN])
        now = time.time()
        return {
            "jobs": [job_view(j, now, brief=True) for j in found.jobs],
            "next_page": found.next_page_token,
            # From the repository's listing index as of this listing: no scan per render.
            "total": core.jobs.count(owner_scope(who), wanted, name[:MAX_NAME_PREFIX]),
        }

    @app.get("/", include_in_schema=False)
    async def jobs_page(
        request: Request, status: str = "", name: str = "", page: str = ""
    ) -> Response:
        session, who = await signed_in(request)
        try:
            listing = await run_in_threadpool(list_jobs, who, status, name, page)
            problem = ""
        except errors.ApiError as exc:
            listing, problem = {"jobs": [], "next_page": "", "total": 0}, exc.message
        query = {"status": status, "name": name}
        next_link = (
            "/?" + urlencode({**query, "page": listing["next_page"]})
            if listing["next_page"]
            else ""
        )
        return templates.page(
            "jobs.html",
            who=who,
            csrf=session.csrf,
            jobs=listing["jobs"],
            total=listing["total"],
            statuses=states.ALL_STATES,
            status=status.upper(),
            name=name,
            page=page,
            next_link=next_link,
            first_link="/?" + urlencode(query) if page else "",
            problem=problem,
        )

    @app.get("/ui/jobs", include_in_schema=False)
    async def jobs_json(
        request: Request, status: str = "", name: str = "", page: str = ""
    ) -> dict[str, Any]:
        _, who = await signed_in(request)
        return await run_in_threadpool(list_jobs, who, status, name, page)

    zone_cache: dict[str, Any] = {"at": 0.0, "zones": None, "prices": None}

    def node_zones() -> dict[str, str] | None:
        """node -> zone from the scheduler, reused for ZONES_TTL_S (every open job page
        asks every 2 s); None when the scheduler cannot say."""
        if time.monotonic() - zone_cache["at"] > ZONES_TTL_S:
            found, problem = nodes()
            zone_cache["zones"] = None if problem else {n["name"]: n["zone"] for n in found}
            zone_cache["prices"] = (
                None if problem else {n["name"]: float(n.get("price_per_hour", 0.0)) for n in found}
            )
            zone_cache["at"] = time.monotonic()
        zones: dict[str, str] | None = zone_cache["zones"]
        return zones

    def full_view(job: JobRecord) -> dict[str, Any]:
        view = with_zones(job_view(job, time.time()), job, node_zones())
        return with_cost(view, job, zone_cache["prices"], time.time())

    # (job id, steps done) -> the simulator's estimate to finish: a page polls, the
    # simulation runs once per step the job reports.
    estimates: OrderedDict[tuple[str, int], dict[str, Any]] = OrderedDict()

    @app.get("/ui/jobs/{job_id}/estimate", include_in_schema=False)
    async def job_estimate(request: Request, job_id: str) -> dict[str, Any]:
        _, who = await signed_in(request)
        job = await run_in_threadpool(core.get, who, job_id)
        if states.is_terminal(job.status):
            return {"problem": f"the job is {job.status}: nothing left to estimate"}
        done = steps_done(job.last_metrics, job.checkpoints)
        key = (job.job_id, done)
        if key not in estimates:
            found = await run_in_threadpool(estimate_to_finish, job.manifest, done)
            estimates[key] = found.to_dict()
            while len(estimates) > MAX_ESTIMATES:
                estimates.popitem(last=False)
        return estimates[key]

    @app.get("/jobs/{job_id}", include_in_schema=False)
    async def job_page(request: Request, job_id: str) -> Response:
        session, who = await signed_in(request)
        try:
            job = await run_in_threadpool(core.get, who, job_id)
        except errors.NotFound:
            return templates.page(
                "error.html",
                404,
                title="No such job",
                message=f"There is no job {job_id!r} that you can see. "
                "It may have been deleted, or belong to someone else.",
                who=who,
                csrf=session.csrf,
            )
        except errors.ApiError as exc:
            return templates.page(
                "error.html",
                exc.http_status,
                title="Cannot show this job",
                message=exc.message,
                who=who,
                csrf=session.csrf,
            )
        view = await run_in_threadpool(full_view, job)
        return templates.page(
            "job.html",
            who=who,
            csrf=session.csrf,
            job=view,
            job_json=json.dumps(view),
            learners=range(int(job.resources.get("learners", 1))),
        )

    @app.get("/ui/jobs/{job_id}", include_in_schema=False)
    async def job_json(request: Request, job_id: str) -> dict[str, Any]:
        _, who = await signed_in(request)
        job = await run_in_threadpool(core.get, who, job_id)
        return await run_in_threadpool(full_view, job)

    @app.post("/ui/jobs/{job_id}/{action}", include_in_schema=False)
    async def job_action(request: Request, job_id: str, action: str) -> dict[str, Any]:
        session, who = await signed_in(request)
        check_csrf(session, request.headers.get(CSRF_HEADER, ""))
        if action == "scale":
            learners = request.query_params.get("learners", "")
            if not learners.isdigit():
                raise errors.BadRequest("scale needs ?learners=N, a whole number of learners")
            job = await run_in_threadpool(core.scale, who, job_id, int(learners))
            return await run_in_threadpool(full_view, job)
        do = {"halt": core.halt, "resume": core.resume, "delete": core.delete}.get(action)
        if do is None:
            raise errors.BadRequest(f"unknown action {action!r}; use halt, resume, delete or scale")
        job = await run_in_threadpool(do, who, job_id, f"{action} from the dashboard")
        return await run_in_threadpool(full_view, job)

    # -- submit ---------------------------------------------------------------------------
    def submit_page(
        who: Principal,
        session: Session,
        code: int = 200,
        manifest: str = "",
        example: str = "",
        problem: str = "",
        manifest_error: str = "",
        code_error: str = "",
    ) -> Response:
        return templates.page(
            "submit.html",
            code,
            who=who,
            csrf=session.csrf,
            examples=list(examples()),
            manifest=manifest,
            example=example,
            problem=problem,
            manifest_error=manifest_error,
            code_error=code_error,
        )

    @app.get("/submit", include_in_schema=False)
    async def submit_form(request: Request) -> Response:
        session, who = await signed_in(request)
        return submit_page(who, session)

    @app.post("/submit", include_in_schema=False)
    async def submit(
        request: Request,
        csrf: str = Form(""),
        manifest: str = Form(""),
        example: str = Form(""),
        code: UploadFile | None = File(None),
    ) -> Response:
        session, who = await signed_in(request)
        check_csrf(session, csrf)
        form = {"manifest": manifest, "example": example}
        if len(manifest.encode()) > MAX_MANIFEST_BYTES:
            return submit_page(
                who,
                session,
                413,
                **form,
                manifest_error=f"The manifest is larger than {MAX_MANIFEST_BYTES} bytes.",
            )
        wrong = manifest_problem(manifest)
        if wrong:
            field = f"Field {wrong['field']}: " if wrong["field"] else ""
            return submit_page(who, session, 400, **form, manifest_error=field + wrong["problem"])
        archive = await code.read(MAX_MODEL_BYTES + 1) if code is not None else b""
        if not archive and example:
            found = examples().get(example)
            if found is None:
                return submit_page(
                    who, session, 400, **form, problem=f"There is no example named {example!r}."
                )
            from services.client.sdk import ClientError, zip_directory

            try:
                archive = await run_in_threadpool(zip_directory, found.folder)
            except ClientError as exc:
                return submit_page(who, session, 400, **form, code_error=exc.message)
        try:
            created = await run_in_threadpool(core.create, who, manifest, archive)
        except errors.ApiError as exc:
            # The API's own words, beside the part of the form they are about.
            where = (
                "code_error" if "archive" in exc.message or "model" in exc.message else "problem"
            )
            return submit_page(who, session, exc.http_status, **form, **{where: exc.message})
        return RedirectResponse(f"/jobs/{quote(created.job.job_id)}", status_code=303)

    @app.post("/ui/validate", include_in_schema=False)
    async def validate(request: Request) -> dict[str, Any]:
        session, _ = await signed_in(request)
        check_csrf(session, request.headers.get(CSRF_HEADER, ""))
        body = await request.body()
        if len(body) > 2 * MAX_MANIFEST_BYTES:
            raise errors.TooLarge(f"the manifest is larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            text = json.loads(body)["manifest"]
        except (ValueError, KeyError, TypeError):
            raise errors.BadRequest('send {"manifest": "<the manifest text>"}') from None
        if not isinstance(text, str):
            raise errors.BadRequest("manifest must be a string")
        wrong = manifest_problem(text)
        return {"valid": not wrong, **wrong}

    @app.get("/ui/examples/{name}", include_in_schema=False)
    async def example_manifest(request: Request, name: str) -> dict[str, str]:
        await signed_in(request)
        found = examples().get(name)
        if found is None:
            raise errors.NotFound(f"there is no example named {name!r}")
        return {"name": found.name, "manifest": found.manifest}

    # -- cluster ----------------------------------------------------------------------------
    def queue(who: Principal) -> list[dict[str, Any]]:
        """The waiting jobs in the order the scheduler considers them (priority, then
        submission), with each one's reason; another user's job is shown without its name."""
        try:
            waiting = core.jobs.by_status([states.QUEUED], limit=QUEUE_SHOWN)
        except (pymongo.errors.PyMongoError, StoreUnavailable) as exc:
            raise errors.Unavailable(f"the job store is unavailable: {exc}") from None
        waiting.sort(key=lambda j: (-j.spec.priority, j.job_id))
        now = time.time()
        out = []
        for position, job in enumerate(waiting, 1):
            mine = who.is_admin or job.owner == who.user
            out.append(
                {
                    "position": position,
                    "job_id": job.job_id if mine else "",
                    "name": job.name if mine else "(another user's job)",
                    "owner": job.owner if who.is_admin else "",
                    "priority": job.spec.priority,
                    "waiting": job_view(job, now, brief=True)["phase"],
                    "reason": job.queue_reason or "not considered yet",
                    "gpus": float(job.resources.get("gpus", 0)),
                    "learners": int(job.resources.get("learners", 1)),
                }
            )
        return out

    def nodes() -> tuple[list[dict[str, Any]], str]:
        if scheduler is None:
            return [], "this REST gateway was started without a channel to the scheduler"
        try:
            view = scheduler.GetCluster(scheduler_pb2.GetClusterRequest(), timeout=10)
        except grpc.RpcError as exc:
            return [], f"the scheduler is unavailable: {exc.details()}"
        rows = [
            json_format.MessageToDict(
                n, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
            )
            for n in view.nodes
        ]
        return sorted(rows, key=lambda n: (n.get("zone", ""), n.get("name", ""))), ""

    def quotas(who: Principal) -> tuple[list[dict[str, Any]], bool, str]:
        """Per user and GPU type: the quota, the limit, the GPUs the user's active jobs
        hold and how many of those are borrowed (beyond the quota): the scheduler's
        configuration, read from its file, and the job records. A user sees their own."""
        if not quota_config:
            return [], True, "no quota configuration: every job is guaranteed, none borrows"
        try:
            config = load_quota_config(quota_config)
            active = core.jobs.by_status(states.ACTIVE_STATES)
        except QuotaConfigError as exc:
            return [], True, str(exc)
        except (pymongo.errors.PyMongoError, StoreUnavailable) as exc:
            return [], True, f"the job store is unavailable: {exc}"
        used: dict[tuple[str, str], float] = {}
        for job in active:
            gpus = float(job.resources.get("gpus", 0)) * int(job.resources.get("learners", 1))
            if gpus:
                key = (job.owner, str(job.resources.get("gpu_type", "")))
                used[key] = used.get(key, 0.0) + gpus
        users = set(config.users) | {u for u, _ in used}
        if not who.is_admin:
            users = {who.user}
        rows = []
        for user in sorted(users):
            entry = config.entry(user)
            types = set(entry.quota) | set(entry.limit) | {t for u, t in used if u == user}
            for gpu_type in sorted(types):
                quota, limit = config.quota(user, gpu_type), config.limit(user, gpu_type)
                held = used.get((user, gpu_type), 0.0)
                rows.append(
                    {
                        "user": user,
                        "gpu_type": gpu_type or "(any)",
                        "quota": quota,
                        "limit": "none" if limit is None else limit,
                        "used": held,
                        "borrowed": max(0.0, held - quota),
                    }
                )
        return rows, config.borrowing, ""

    @app.get("/cluster", include_in_schema=False)
    async def cluster_page(request: Request) -> Response:
        session, who = await signed_in(request)
        waiting = await run_in_threadpool(queue, who)
        found, problem = await run_in_threadpool(nodes)
        quota_rows, borrowing, quota_problem = await run_in_threadpool(quotas, who)
        zones: dict[str, list[dict[str, Any]]] = {}
        for n in found:
            zones.setdefault(n.get("zone") or "(no zone)", []).append(n)
        return templates.page(
            "cluster.html",
            who=who,
            csrf=session.csrf,
            zones=zones,
            nodes_problem=problem,
            queue=waiting,
            shown=QUEUE_SHOWN,
            quotas=quota_rows,
            borrowing=borrowing,
            quota_problem=quota_problem,
        )

    # -- spot estimate ------------------------------------------------------------------------
    @app.get("/estimate", include_in_schema=False)
    async def estimate_page(request: Request) -> Response:
        session, who = await signed_in(request)
        return templates.page(
            "estimate.html",
            who=who,
            csrf=session.csrf,
            traces=bundled_traces(),
            runs=DEFAULT_RUNS,
            example=ESTIMATE_EXAMPLE,
        )

    @app.post("/ui/estimate", include_in_schema=False)
    async def estimate_json(request: Request) -> Response:
        session, _ = await signed_in(request)
        check_csrf(session, request.headers.get(CSRF_HEADER, ""))
        body = await request.body()
        if len(body) > 2 * MAX_MANIFEST_BYTES:
            raise errors.TooLarge(f"the manifest is larger than {MAX_MANIFEST_BYTES} bytes")
        try:
            asked = json.loads(body)
            args = (
                str(asked["manifest"]),
                str(asked.get("trace", "")),
                str(asked.get("mttp", "")),
                int(asked.get("runs", DEFAULT_RUNS)),
            )
        except (ValueError, KeyError, TypeError):
            raise errors.BadRequest(
                'send {"manifest": "...", "trace": "aws-p3-64.csv" or "mttp": "3h", "runs": 5}'
            ) from None
        try:
            return JSONResponse(await run_in_threadpool(estimate, *args))
        except EstimateRefused as exc:
            return JSONResponse({"code": "bad_request", "message": str(exc)}, status_code=400)

    # -- live logs and metrics (server-sent events) -----------------------------------------
    def event_stream(method: str, request: Any, start: int) -> StreamingResponse:
        if tds is None:
            raise errors.Unavailable("the training data service (tds) is not configured")

        async def events() -> AsyncIterator[bytes]:
            call = getattr(tds, method)(request)
            items: Iterator[Any] = iter(call)
            pos = start
            # Tells the browser how soon to reconnect after the stream drops.
            yield b"retry: 2000\n\n"
            try:
                while True:
                    # The blocking read runs on a worker thread; abandoned on a disconnect,
                    # after which cancelling the call ends that thread's wait.
                    item = await anyio.to_thread.run_sync(next, items, None, abandon_on_cancel=True)
                    if item is None:
                        yield b"event: end\ndata: {}\n\n"
                        return
                    pos += 1
                    body = json_format.MessageToDict(item, preserving_proto_field_name=True)
                    yield f"id: {pos}\ndata: {json.dumps(body)}\n\n".encode()
            except grpc.RpcError as exc:
                message = {"message": f"the log service failed: {exc.details()}"}
                yield f"event: problem\ndata: {json.dumps(message)}\n\n".encode()
            finally:
                call.cancel()

        return StreamingResponse(
            events(),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    def resume_position(request: Request) -> int:
        last = request.headers.get("last-event-id", "")
        return int(last) if last.isdigit() else 0

    @app.get("/ui/jobs/{job_id}/logs", include_in_schema=False)
    async def job_logs(
        request: Request, job_id: str, learner: int = -1, search: str = ""
    ) -> Response:
        _, who = await signed_in(request)
        await run_in_threadpool(core.get, who, job_id)  # ownership, and a clear 404
        if len(search) > MAX_LOG_SEARCH:
            raise errors.BadRequest(f"search is longer than {MAX_LOG_SEARCH} characters")
        pos = resume_position(request)
        req = tds_pb2.LogsRequest(
            job_id=job_id, follow=not search, learner=max(-1, learner), search=search, pos=pos
        )
        return event_stream("GetLogs", req, pos)

    @app.get("/ui/jobs/{job_id}/metrics", include_in_schema=False)
    async def job_metrics(request: Request, job_id: str) -> Response:
        _, who = await signed_in(request)
        await run_in_threadpool(core.get, who, job_id)
        pos = resume_position(request)
        req = tds_pb2.MetricsRequest(job_id=job_id, follow=True, learner=-1, pos=pos)
        return event_stream("GetMetrics", req, pos)

    @app.get("/ui/{rest:path}", include_in_schema=False)
    def ui_unknown(rest: str) -> JSONResponse:
        return JSONResponse(
            {"code": "not_found", "message": f"no dashboard route /ui/{quote(rest)}"}, 404
        )

    return sessions
