"""etcd's users and roles: authentication turned on, and each job's own user.

Every job's learners reach etcd as a user of their own whose role reads and writes only
under the job's prefix (docs/security.md). The LCM makes and removes those users with one
long-lived root client, in batches (`JobUsers`): every auth change makes etcd refuse every
client's token, so a burst of changes made back to back costs the other clients one new
token, not one per change. With `contract.etcd` (the client) the only modules that import
the etcd library (`pyetcd`).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from contract.credentials import redact_uri
from contract.etcd import (
    _UNREACHABLE,
    EtcdClient,
    EtcdCredentials,
    StoreUnavailable,
    _auth_refusal,
)


def _auth(raw: Any) -> dict[str, Any]:
    """The caller's etcd token for a raw stub call (the library adds it only to its own
    methods); nothing before authentication is enabled."""
    return {"metadata": raw.metadata, "credentials": raw.call_credentials}


def grant_prefix(raw: Any, role: str, prefix: str, timeout_s: float = 5.0) -> None:
    """Create `role` (if missing) with read-write on every key under `prefix`."""
    from pyetcd import etcdrpc
    from pyetcd.etcdrpc import auth_pb2
    from pyetcd.utils import prefix_range_end

    with contextlib.suppress(grpc.RpcError):  # it exists already
        raw.authstub.RoleAdd(etcdrpc.AuthRoleAddRequest(name=role), timeout_s, **_auth(raw))
    permission = auth_pb2.Permission(
        permType=auth_pb2.Permission.READWRITE,
        key=prefix.encode(),
        range_end=prefix_range_end(prefix.encode()),
    )
    raw.authstub.RoleGrantPermission(
        etcdrpc.AuthRoleGrantPermissionRequest(name=role, perm=permission), timeout_s, **_auth(raw)
    )


def add_user(raw: Any, credentials: EtcdCredentials, role: str, timeout_s: float = 5.0) -> None:
    """Create the etcd user of `credentials` (or set its password) with `role`."""
    from pyetcd import etcdrpc

    try:
        raw.authstub.UserAdd(
            etcdrpc.AuthUserAddRequest(name=credentials.user, password=credentials.password),
            timeout_s,
            **_auth(raw),
        )
    except grpc.RpcError:  # it exists: make its password the one we hold
        raw.authstub.UserChangePassword(
            etcdrpc.AuthUserChangePasswordRequest(
                name=credentials.user, password=credentials.password
            ),
            timeout_s,
            **_auth(raw),
        )
    raw.authstub.UserGrantRole(
        etcdrpc.AuthUserGrantRoleRequest(user=credentials.user, role=role), timeout_s, **_auth(raw)
    )


def enable_auth(
    url: str, root: EtcdCredentials, platform: EtcdCredentials, prefix: str, timeout_s: float = 5.0
) -> None:
    """Turn on etcd's authentication: `root` (etcd's superuser, which enabling requires)
    and `platform`, a user whose role `platform.user` reads and writes only under
    `prefix`. Called on an etcd without authentication; one that has it already is left
    as it is (its users were made by an earlier call)."""
    from pyetcd import etcdrpc

    client = EtcdClient(url, timeout_s, anonymous=True)
    try:
        with client._errors("enable authentication"):
            raw = client.raw
            try:
                raw.authstub.UserList(etcdrpc.AuthUserListRequest(), timeout_s)
            except grpc.RpcError as exc:
                if _auth_refusal(exc):
                    return  # authentication is on: only an authenticated caller may ask
                raise
            add_user(raw, root, "root", timeout_s)
            grant_prefix(raw, platform.user, prefix, timeout_s)
            add_user(raw, platform, platform.user, timeout_s)
            raw.authstub.AuthEnable(etcdrpc.AuthEnableRequest(), timeout_s)
    finally:
        client.close()


def job_etcd_user(job_id: str) -> str:
    """The etcd user (and role) of `job_id`'s learners."""
    return f"rhizome-job-{job_id}"


def job_etcd_password(root: EtcdCredentials, job_id: str) -> str:
    """The password of `job_id`'s etcd user, derived from the root password: the same for
    every guardian the LCM starts for the job, so a restarted guardian's learners (which
    keep the password they were given) can still authenticate; rotating the root
    password changes every job's."""
    digest = hmac.new(root.password.encode(), f"etcd-job:{job_id}".encode(), hashlib.sha256)
    return digest.hexdigest()


def add_job_user(
    url: str,
    root: EtcdCredentials,
    job_id: str,
    timeout_s: float = 5.0,
    password: str | None = None,
) -> EtcdCredentials:
    """An etcd user for `job_id`'s learners whose role reads and writes only under the
    job's own prefix (`etcd_keys.job_prefix`: its status, control, runtime and elastic
    keys all live there), with `password` (default: a fresh random one). Creating users
    takes etcd's root user. Called again for the same job, it sets the password given.
    One job with a client of its own; the LCM keeps one `JobUsers` for all of them."""
    import secrets

    with JobUsers(url, root, timeout_s) as users:
        return users.add(job_id, password or secrets.token_urlsafe(24))


def remove_job_user(url: str, root: EtcdCredentials, job_id: str, timeout_s: float = 5.0) -> None:
    """Delete `job_id`'s etcd user and role (when the job ends for good); nothing to do
    when they are gone already."""
    with JobUsers(url, root, timeout_s) as users:
        users.remove(job_id)


@dataclass(frozen=True)
class JobUserChange:
    """One job's etcd user to make (`password` given) or to remove (`password` None)."""

    job_id: str
    password: str | None = field(default=None, repr=False)

    @property
    def adds(self) -> bool:
        return self.password is not None


@dataclass(frozen=True)
class JobUserOutcome:
    """What became of one `JobUserChange`: the user made (`credentials`; None for a
    removal), or `error`, which failed that job's change only."""

    job_id: str
    credentials: EtcdCredentials | None = None
    error: StoreUnavailable | None = None


# etcd's answers (their details) that mean the change is already there: a role or user
# made before (a job set up again) or removed before.
_ALREADY_THERE = ("already exists",)
_ALREADY_GONE = ("not found",)
# Codes of a call that did not reach etcd, or got no answer: the next change of a batch
# would not either, so the rest of it fails at once instead of each waiting its deadline.
_NO_ANSWER = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class JobUsers:
    """Makes and removes jobs' etcd users and roles, with one long-lived root client (the
    LCM holds one for all its jobs).

    A job's user is four auth changes (RoleAdd, RoleGrantPermission, UserAdd,
    UserGrantRole), its removal two (UserDelete, RoleDelete), and after each one etcd
    refuses every client's token once: each client authenticates again (a password hash
    in etcd) at its next call. `apply` makes the changes of many jobs back to back, in one
    burst, so a client is refused about once a burst instead of once a change. The root
    client is authenticated once, not once per job: etcd checks an auth change's caller
    for its root role, not its token's revision, and a token that lapsed (idle past
    etcd's `--auth-token-ttl`) is replaced by `EtcdClient._run`'s retry. Thread-safe: the
    changes of concurrent callers are serialized."""

    def __init__(self, url: str, root: EtcdCredentials, timeout_s: float = 5.0) -> None:
        self.url = url
        self.root = root
        self.timeout_s = timeout_s
        self.changes = 0  # auth changes etcd applied for us (tests, logs)
        self.clients = 0  # root clients opened (one, unless etcd was unreachable)
        self._client: EtcdClient | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> JobUsers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            self._drop_client()

    def add(self, job_id: str, password: str) -> EtcdCredentials:
        """`job_id`'s user with `password` (see `add_job_user`); StoreUnavailable if not."""
        outcome = self.apply([JobUserChange(job_id, password)])[0]
        if outcome.error is not None:
            raise outcome.error
        assert outcome.credentials is not None
        return outcome.credentials

    def remove(self, job_id: str) -> None:
        """Delete `job_id`'s user and role (nothing to do if gone); StoreUnavailable if not."""
        outcome = self.apply([JobUserChange(job_id)])[0]
        if outcome.error is not None:
            raise outcome.error

    def apply(self, changes: list[JobUserChange]) -> list[JobUserOutcome]:
        """Make every change, in order, back to back; one outcome per change. A change
        that etcd refuses fails its own job only, the others go on; once etcd does not
        answer at all (unreachable, past the deadline), the rest fail with that error."""
        outcomes: list[JobUserOutcome] = []
        with self._lock:
            stop: StoreUnavailable | None = None
            try:
                client = self._root_client()
            except StoreUnavailable as exc:  # EtcdAuthError included: no change can be made
                stop = exc
            for change in changes:
                user = job_etcd_user(change.job_id)
                what = f"{'add' if change.adds else 'remove'} etcd user {_shown(user)}"
                if stop is not None:
                    error = StoreUnavailable(f"cannot {what}: {stop}")
                    error.__cause__ = stop.__cause__
                    outcomes.append(JobUserOutcome(change.job_id, error=error))
                    continue
                try:
                    credentials = self._apply(client, change, user)
                    outcomes.append(JobUserOutcome(change.job_id, credentials))
                except StoreUnavailable as exc:  # names the change and etcd's answer
                    outcomes.append(JobUserOutcome(change.job_id, error=exc))
                    if _no_answer(exc):
                        stop = exc
                        self._drop_client()  # a new channel for the next batch
        return outcomes

    def _root_client(self) -> EtcdClient:
        if self._client is None:
            self._client = EtcdClient(self.url, self.timeout_s, credentials=self.root)
            self.clients += 1
        return self._client

    def _drop_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def _apply(
        self, client: EtcdClient, change: JobUserChange, user: str
    ) -> EtcdCredentials | None:
        from pyetcd import etcdrpc
        from pyetcd.etcdrpc import auth_pb2
        from pyetcd.utils import prefix_range_end

        from contract import etcd_keys

        raw, timeout_s = client.raw, self.timeout_s
        shown = _shown(user)
        auth = raw.authstub
        if not change.adds:
            self._change(
                client,
                f"remove etcd user {shown}",
                _ALREADY_GONE,
                lambda: auth.UserDelete(
                    etcdrpc.AuthUserDeleteRequest(name=user), timeout_s, **_auth(raw)
                ),
            )
            self._change(
                client,
                f"remove etcd role {shown}",
                _ALREADY_GONE,
                lambda: auth.RoleDelete(
                    etcdrpc.AuthRoleDeleteRequest(role=user), timeout_s, **_auth(raw)
                ),
            )
            return None
        assert change.password is not None
        credentials = EtcdCredentials(user, change.password)
        prefix = etcd_keys.job_prefix(change.job_id).encode()
        permission = auth_pb2.Permission(
            permType=auth_pb2.Permission.READWRITE, key=prefix, range_end=prefix_range_end(prefix)
        )
        self._change(
            client,
            f"add etcd role {shown}",
            _ALREADY_THERE,
            lambda: auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name=user), timeout_s, **_auth(raw)),
        )
        self._change(
            client,
            f"grant etcd role {shown} its prefix",
            (),
            lambda: auth.RoleGrantPermission(
                etcdrpc.AuthRoleGrantPermissionRequest(name=user, perm=permission),
                timeout_s,
                **_auth(raw),
            ),
        )
        try:
            self._change(
                client,
                f"add etcd user {shown}",
                (),
                lambda: auth.UserAdd(
                    etcdrpc.AuthUserAddRequest(name=user, password=change.password),
                    timeout_s,
                    **_auth(raw),
                ),
            )
        except StoreUnavailable as exc:
            if not _answered(exc, _ALREADY_THERE):
                raise
            # it exists (the job set up again): make its password the one given
            self._change(
                client,
                f"set the password of etcd user {shown}",
                (),
                lambda: auth.UserChangePassword(
                    etcdrpc.AuthUserChangePasswordRequest(name=user, password=change.password),
                    timeout_s,
                    **_auth(raw),
                ),
            )
        self._change(
            client,
            f"grant etcd user {shown} its role",
            (),
            lambda: auth.UserGrantRole(
                etcdrpc.AuthUserGrantRoleRequest(user=user, role=user), timeout_s, **_auth(raw)
            ),
        )
        return credentials

    def _change(
        self, client: EtcdClient, what: str, done_if: tuple[str, ...], call: Callable[[], Any]
    ) -> None:
        """One auth change through the client's token retry; etcd's answer that it is
        there already (`done_if`) counts as done. `call` reads the client's token when it
        runs, so a retry sends the new one."""

        def attempt() -> bool:
            try:
                call()
            except grpc.RpcError as exc:
                if done_if and _answered_rpc(exc, done_if):
                    return False
                raise
            return True

        try:
            changed = client._run(what, attempt)
        except StoreUnavailable as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.RpcError) and not _no_answer(exc):
                # etcd answered no: say so in its words (not "unreachable")
                refused = type(exc)(
                    f"etcd at {redact_uri(self.url)} refused to {what}: {cause.code().name} "
                    f"{cause.details() or ''}".rstrip()
                )
                raise refused from cause
            raise
        if changed:
            self.changes += 1


def _shown(name: str, most: int = 100) -> str:
    """`name` for a message: cut when long (a job id is the caller's)."""
    return name if len(name) <= most else f"{name[:most]}..."


def _answered_rpc(exc: grpc.RpcError, phrases: tuple[str, ...]) -> bool:
    details = str(exc.details() or "")
    return any(p in details for p in phrases)


def _answered(exc: BaseException, phrases: tuple[str, ...]) -> bool:
    """Whether etcd's answer behind `exc` (a StoreUnavailable) says one of `phrases`."""
    cause = exc.__cause__
    return isinstance(cause, grpc.RpcError) and _answered_rpc(cause, phrases)


def _no_answer(exc: BaseException) -> bool:
    """Whether the call behind `exc` got no answer from etcd (as against a refusal)."""
    cause = exc.__cause__
    if isinstance(cause, grpc.RpcError):
        return cause.code() in _NO_ANSWER
    return cause is None or isinstance(cause, _UNREACHABLE)
