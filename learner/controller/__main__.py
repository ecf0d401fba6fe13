"""`python -m learner.controller --spec PATH`: run one learner (see controller.py).

Exit codes (`contract.status.ExitCode`): USAGE when the spec cannot be read,
CONFIG_ERROR (one line naming the variable) when a learner variable is malformed,
otherwise what `Controller.run` returns."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from contract.env import ETCD_CREDENTIALS_FILE, LearnerConfigError, LearnerEnv
from contract.etcd import EtcdClient, EtcdCredentials
from contract.learner_spec import LearnerSpec
from contract.status import ExitCode
from learner.controller.controller import Controller, keep_streams_for_command

# In the learner's own directory (its uid's, 0700 above it), mode 0600.
ETCD_CREDENTIALS_FILE_NAME = "etcd.credentials"


# grpc's blocking waits (a stream's next message, a future's result) sleep in slices of
# `grpc._common.MAXIMUM_WAIT_TIMEOUT` (0.1 s), so that a signal handler in a main thread
# blocked there runs within 0.1 s. A running job's controller holds such waits all the time
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
    parser = argparse.ArgumentParser(prog="python -m learner.controller", description=__doc__)
    quiet_grpc_waits()
    parser.add_argument("--spec", required=True, type=Path, help="the learner's spec.json")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        spec = LearnerSpec.load(args.spec)
    except (OSError, ValueError, TypeError) as exc:
        print(f"learner controller: cannot read spec {args.spec}: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    try:
        # Our own labels and what the command will get: refuse both before starting it.
        LearnerEnv.from_environ({**os.environ, **spec.env})
    except LearnerConfigError as exc:
        print(f"learner controller: {exc}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    if spec.etcd_credentials:
        # The job's own etcd user, for this controller and, through the file the variable
        # names, for its command (the runtime's store, the elastic worker): every
        # `EtcdClient` of theirs authenticates by itself (contract/etcd.py).
        path = spec.learner_dir / ETCD_CREDENTIALS_FILE_NAME
        try:
            EtcdCredentials.parse(spec.etcd_credentials).write(path)
        except (OSError, ValueError) as exc:
            print(f"learner controller: cannot keep its etcd credentials: {exc}", file=sys.stderr)
            return ExitCode.USAGE
        os.environ[ETCD_CREDENTIALS_FILE] = str(path)
    controller = Controller(spec, EtcdClient(spec.etcd_url))
    if spec.passthrough:
        # Our stdout/stderr are the container's: the command's from here on (errors above,
        # before the command could run, are worth seeing in the job's logs).
        try:
            spec.learner_dir.mkdir(parents=True, exist_ok=True)
            controller.command_fds = keep_streams_for_command(spec.learner_dir / "controller.log")
        except OSError as exc:
            print(
                f"learner controller: cannot open its log in {spec.learner_dir}: {exc}",
                file=sys.stderr,
            )
            return ExitCode.USAGE

    def on_term(*_: object) -> None:
        controller.terminate.set()
        controller.wake.set()

    signal.signal(signal.SIGTERM, on_term)
    return controller.run()


if __name__ == "__main__":
    sys.exit(main())
