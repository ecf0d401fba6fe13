"""The jobs' set-ups (their etcd user, token, certificate: what a guardian is given), and
the removals of ended jobs' etcd users, on one thread of the LCM, in batches.

Why batches: a job's etcd user is four auth changes in etcd and its removal two, and after
each one etcd refuses every client's token once (every guardian host, learner and daemon
then authenticates again at its next call). Made one job after another, a burst of
submits refused each busy client's token about once per change (1,314 re-authentications
of the hosts at N=1,000, benchmarks/RESULTS.md). Here every set-up and removal waiting is
taken together: their auth changes are made back to back (`JobUsers.apply`, one
long-lived root client), then the rest of each job's set-up, so a client is refused about
once a batch. A batch is at most `max_batch` jobs, and the next one waits `gap_s` (which
also lets set-ups asked for meanwhile join it): while
the changes run, every other client's calls are refused, so a batch must stay short
enough for their retries (contract/etcd.py `_TOKEN_RETRIES`) and leave them a moment
between two.

What does not change: a job's credentials exist before its guardian is given to a host
(its future is done after its user was made); a set-up that fails (its user refused by
etcd, its certificate not issued) fails only its own job, logged with the reason (its
future gives None: the LCM's next round tries again); removals and set-ups are made in
the order they were asked for, so a job halted and resumed at once ends with a user.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from contract.etcd_users import JobUserChange, JobUsers
from services.security.api import JOB_ETCD_CREDENTIALS_ENV

log = logging.getLogger("rhizome.lcm")

# At most this many jobs' auth changes in one burst (4 a set-up, 2 a removal: 1-6 ms each
# in etcd, so a burst of 50 set-ups lasts 0.2-1.2 s): the other clients' calls are
# refused meanwhile and wait (contract/etcd.py _TOKEN_RETRIES says how long they may).
MAX_BATCH = 50
# The pause after a full batch, when more wait: the other clients get new tokens and make
# their calls before the next burst refuses them again.
BATCH_GAP_S = 0.05

Env = dict[str, str]


@dataclass
class _Request:
    job_id: str
    future: Future[Env | None] | None  # None: remove the job's etcd user


@dataclass
class SetupStats:
    """What the set-up thread did so far (the LCM logs it; the benchmark reads it)."""

    setups: int = 0
    failed: int = 0
    removals: int = 0
    batches: int = 0
    largest: int = 0
    users_s: float = 0.0  # in etcd's auth changes
    rest_s: float = 0.0  # the rest of the set-ups (token, certificate)


class JobSetups:
    """`submit(job)` a job's set-up, `remove(job)` its etcd user; one thread does both, in
    batches (the module's docstring says why). `users` is None where etcd has no
    authentication (no users to make); `password(job)` the password of a job's user;
    `rest(job)` the rest of its set-up (None, logged by it, when it cannot be made)."""

    def __init__(
        self,
        users: JobUsers | None,
        password: Callable[[str], str],
        rest: Callable[[str], Env | None],
        max_batch: int = MAX_BATCH,
        gap_s: float = BATCH_GAP_S,
        start: bool = True,
    ) -> None:
        self.users = users
        self.password = password
        self.rest = rest
        self.max_batch = max_batch
        self.gap_s = gap_s
        self.stats = SetupStats()
        self._queue: list[_Request] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="job-setup", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> JobSetups:
        """Start the thread (made with `start=False`: what was asked meanwhile is its
        first batch)."""
        self._thread.start()
        return self

    def submit(self, job_id: str) -> Future[Env | None]:
        """The job's set-up; its future gives the guardian's environment, or None."""
        future: Future[Env | None] = Future()
        with self._cond:
            if self._closing:
                future.cancel()
                return future
            self._queue.append(_Request(job_id, future))
            self._cond.notify()
        return future

    def remove(self, job_id: str) -> None:
        """Delete the job's etcd user and role, in the next batch (logged if it fails)."""
        if self.users is None:
            return
        with self._cond:
            self._queue.append(_Request(job_id, None))
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel the set-ups not begun; the removals asked for are still made (within
        `timeout_s`): a user left behind would outlive its job."""
        with self._cond:
            self._closing = True
            for request in self._queue:
                if request.future is not None:
                    request.future.cancel()
            self._queue = [r for r in self._queue if r.future is None]
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return  # closing, nothing left
                batch = self._queue[: self.max_batch]
                del self._queue[: self.max_batch]
            try:
                self._batch(batch)
            except Exception:  # a bug must not stop every later set-up
                log.exception("job set-up batch failed")
                for request in batch:
                    if request.future is not None and not request.future.done():
                        request.future.set_result(None)
            with self._cond:
                more = bool(self._queue) and not self._closing
            if more:
                time.sleep(self.gap_s)

    def _batch(self, batch: list[_Request]) -> None:
        # Set-ups cancelled while they waited (the LCM stopping) are dropped.
        batch = [r for r in batch if r.future is None or r.future.set_running_or_notify_cancel()]
        if not batch:
            return
        self.stats.batches += 1
        self.stats.largest = max(self.stats.largest, len(batch))
        started = time.monotonic()
        errors: dict[int, str] = {}
        credentials: dict[int, str] = {}
        if self.users is not None:
            changes = [
                JobUserChange(r.job_id, self.password(r.job_id) if r.future else None)
                for r in batch
            ]
            for i, outcome in enumerate(self.users.apply(changes)):
                if outcome.error is not None:
                    errors[i] = str(outcome.error)
                elif outcome.credentials is not None:
                    credentials[i] = outcome.credentials.line()
        users_done = time.monotonic()
        self.stats.users_s += users_done - started
        for i, request in enumerate(batch):
            if request.future is None:
                self.stats.removals += 1
                if i in errors:
                    log.warning(
                        "job %s: cannot remove its etcd user (%s)", request.job_id, errors[i]
                    )
                continue
            self.stats.setups += 1
            env = self._rest(request.job_id, errors.get(i), credentials.get(i))
            if env is None:
                self.stats.failed += 1
            request.future.set_result(env)
        self.stats.rest_s += time.monotonic() - users_done

    def _rest(self, job_id: str, error: str | None, credentials: str | None) -> Env | None:
        if error is not None:
            log.error(
                "job %s: cannot make its etcd user (%s); not starting its guardian", job_id, error
            )
            return None
        try:
            env = self.rest(job_id)
        except Exception:
            log.exception("job %s: its set-up failed; not starting its guardian", job_id)
            return None
        if env is not None and credentials is not None:
            env[JOB_ETCD_CREDENTIALS_ENV] = credentials
        return env
