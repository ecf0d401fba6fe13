"""`python -m services.guardian --job-id J ...`: run one job's guardian (guardian.py).

Started by the LCM; exit codes (`contract.status.ExitCode`): OK (0) the job left the
guardian's hands (ended, halted), FATAL (3) another guardian holds the job, EVICTED (4)
the guardian lost its lease, PREEMPTED (143) terminated, USAGE (2) bad arguments or no
store."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from contract import procs
from contract.credentials import tls_from_json
from contract.etcd import EtcdClient
from contract.status import ExitCode
from services.backends.api import get_backend
from services.guardian.config import GuardianConfig
from services.guardian.guardian import Guardian
from services.security.api import (
    GUARDIAN_ETCD_URL_ENV,
    GUARDIAN_MONGODB_URI_ENV,
    GUARDIAN_SERVICE_TOKEN_ENV,
    JOB_ETCD_CREDENTIALS_ENV,
    JOB_TLS_DIR_ENV,
    JOB_TLS_ENV,
    JOB_TOKEN_ENV,
)
from services.store.errors import StoreUnavailable
from services.store.jobs import JobsRepository
from services.store.mongo import connect
from services.store.preemption_stats import PreemptionStatsRepository

# How long an exited child nobody watches is left to whoever started it (subprocess.run
# waits for its own child: reaped here first, it would read exit code 0) before it is
# reaped as an orphan: the Reaper's old poll interval, which gave them that much.
UNWATCHED_GRACE_S = 0.05


class WaitingReaper(procs.Reaper):
    """The guardian process's reaper (and the LCM's, services/lcm/manager.py): its thread
    sleeps in `waitid` on any child until one exits (a learner's controller, a guardian,
    an adopted orphan), instead of the Reaper's poll every 50 ms. That poll was the busiest thread of a running pipeline job's guardian, on the
    cores its workers train on (issue #16, benchmarks/RESULTS.md "session 10"); a watched
    child's exit is now seen at once rather than within 50 ms. `WNOWAIT` leaves the child
    to `reap_once`, which reaps and reports every exited child as before; a child nobody
    watches is reaped UNWATCHED_GRACE_S later. With no child at all (before the deploy)
    `waitid` fails at once: the thread then waits for `watch` (a child just started) or
    `interval_s` (an orphan adopted meanwhile)."""

    def __init__(self, interval_s: float = 1.0) -> None:
        super().__init__(interval_s)
        self._child = threading.Event()
        # Called with the child's pid (in the reaper's thread) after a watched child's exit
        # was reported: the guardian process's wake-up, so that it need not poll its
        # controllers' pids (`Guardian.exit_wakes`, `Guardian.quiet_wait_s`); a guardian
        # host's, which steps the guardian whose controller it was (host.py).
        self.on_exit: Callable[[int], None] | None = None

    def watch(self, pid: int, callback: Callable[[int, int], None]) -> None:
        def then_wake(pid: int, code: int) -> None:
            try:
                callback(pid, code)
            finally:
                if self.on_exit is not None:
                    self.on_exit(pid)

        super().watch(pid, then_wake)
        self._child.set()

    def watches(self, pid: int) -> bool:
        """Whether `pid` is a child whose exit this reaper will report (and so call
        `on_exit`): watched and not yet exited."""
        with self._lock:
            return pid in self._callbacks

    def _watched(self, pid: int) -> bool:
        return self.watches(pid)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                exited = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                self._child.wait(self.interval_s)
                self._child.clear()
                continue
            # Stopped while asleep in `waitid` (the thread cannot be woken there): reap
            # nothing more, as the polling Reaper's thread ends at its next wait. A stopped
            # reaper that went on reaping would take the exit codes of children its process
            # still waits for (an LCM stopped inside a longer-lived process: the tests).
            if self._stop.is_set():
                return
            if (
                exited is not None
                and not self._watched(exited.si_pid)
                and self._stop.wait(UNWATCHED_GRACE_S)
            ):
                return
            self.reap_once()


def _job_tls(raw: str) -> dict[str, str]:
    """The LCM's `{ca, cert, key}` for the learners' TDS channel; {} on plaintext."""
    return tls_from_json(raw, JOB_TLS_ENV, " (the LCM writes it)")


def pop_job_credentials(env: MutableMapping[str, str]) -> dict[str, Any]:
    """The job's credentials the LCM hands its guardian (GuardianConfig's fields), popped
    from `env` so that nothing the guardian starts inherits them except through the
    learner spec: the job token for the learners' collectors, their TDS client
    certificate, the job's etcd user, the CA directory to renew the certificate from, and
    the service credential for the scheduler."""
    return {
        "tds_token": env.pop(JOB_TOKEN_ENV, ""),
        "tds_tls": _job_tls(env.pop(JOB_TLS_ENV, "")),
        "etcd_credentials": env.pop(JOB_ETCD_CREDENTIALS_ENV, ""),
        "tds_tls_dir": env.pop(JOB_TLS_DIR_ENV, ""),
        "scheduler_token": env.pop(GUARDIAN_SERVICE_TOKEN_ENV, ""),
    }


# grpc's blocking waits (a stream's next message, a future's result) sleep in slices of
# `grpc._common.MAXIMUM_WAIT_TIMEOUT` (0.1 s), so that a signal handler in a main thread
# blocked there runs within 0.1 s. A running job's guardian holds such waits all the time
# (its etcd watch, its lease's keep-alive stream): each woke 10 times a second, on the
# cores the job's workers train on. The slice only bounds how late a waiter looks again
# without being notified (a message wakes it at once), and our SIGTERM handler only sets
# events: 1 s is enough. Measured idle (an etcd client, a watch, a lease at TTL/4):
# 0.0055 -> 0.0039 CPU s per second (issue #16, benchmarks/RESULTS.md "session 10").
GRPC_WAIT_SLICE_S = 1.0


def quiet_grpc_waits() -> None:
    """Make grpc's blocking waits wake every GRPC_WAIT_SLICE_S (see above)."""
    import grpc._common

    grpc._common.MAXIMUM_WAIT_TIMEOUT = max(grpc._common.MAXIMUM_WAIT_TIMEOUT, GRPC_WAIT_SLICE_S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.guardian", description=__doc__)
    quiet_grpc_waits()
    parser.add_argument("--job-id", required=True)
    # The LCM passes both URIs in the environment (popped below, so the learners do not
    # inherit them): a command line is readable by every local user and a URI may hold a
    # password. The flags remain for running a guardian by hand.
    parser.add_argument(
        "--etcd", default="", help=f"etcd client URL (default: ${GUARDIAN_ETCD_URL_ENV})"
    )
    parser.add_argument(
        "--mongodb-uri", default="", help=f"MongoDB URI (default: ${GUARDIAN_MONGODB_URI_ENV})"
    )
    parser.add_argument("--data-dir", required=True, type=Path)
    parser.add_argument("--backend", default="local")
    parser.add_argument("--tds", default="", help="TDS address for the learners' log collectors")
    parser.add_argument(
        "--scheduler",
        default="",
        help="the scheduler's internal address (HOST:PORT): where a lost pipeline learner's "
        f"replacement runs (ReplaceLearner, with the credential in ${GUARDIAN_SERVICE_TOKEN_ENV}); "
        "none: the replacement reuses the lost learner's node",
    )
    args = parser.parse_args(argv)
    # Popped whatever the flags say, so that nothing this guardian starts inherits them.
    etcd_url = args.etcd or os.environ.pop(GUARDIAN_ETCD_URL_ENV, "")
    mongodb_uri = args.mongodb_uri or os.environ.pop(GUARDIAN_MONGODB_URI_ENV, "")
    os.environ.pop(GUARDIAN_ETCD_URL_ENV, None)
    os.environ.pop(GUARDIAN_MONGODB_URI_ENV, None)
    if not etcd_url or not mongodb_uri:
        missing = [
            f"--etcd or ${GUARDIAN_ETCD_URL_ENV}" if not etcd_url else "",
            f"--mongodb-uri or ${GUARDIAN_MONGODB_URI_ENV}" if not mongodb_uri else "",
        ]
        parser.error("missing " + " and ".join(m for m in missing if m))
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s %(levelname)s guardian[{args.job_id}]: %(message)s"
    )
    try:
        config = GuardianConfig.from_env(
            job_id=args.job_id,
            etcd_url=etcd_url,
            mongodb_uri=mongodb_uri,
            data_dir=args.data_dir,
            backend=args.backend,
            tds_address=args.tds,
            scheduler_address=args.scheduler,
            **pop_job_credentials(os.environ),
        )
        etcd = EtcdClient.connect(config.etcd_url)
        db = connect(config.mongodb_uri)
        jobs = JobsRepository(db)
        stats = PreemptionStatsRepository(db)
    except (StoreUnavailable, ValueError) as exc:
        print(f"guardian: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    # Orphans of our learners (a controller died) land on us, and we reap them.
    procs.become_subreaper()
    reaper = WaitingReaper()
    reaper.start()
    backend = get_backend(config.backend, reaper=reaper)
    guardian = Guardian(config, etcd, jobs, backend, stats)
    # A controller this process started wakes the guardian as it exits: no poll of its
    # pid between two changes (Guardian.quiet_wait_s).
    reaper.on_exit = lambda pid: guardian.wake.set()
    guardian.exit_wakes = reaper.watches

    def on_term(*_: object) -> None:
        guardian.terminate.set()
        guardian.wake.set()

    signal.signal(signal.SIGTERM, on_term)
    return guardian.run()


if __name__ == "__main__":
    sys.exit(main())
