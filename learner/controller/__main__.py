"""`python -m learner.controller --spec PATH`: run one learner (see controller.py)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from learner.controller.controller import Controller, LearnerSpec
from learner.controller.etcdio import EtcdIO


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner.controller", description=__doc__)
    parser.add_argument("--spec", required=True, type=Path, help="the learner's spec.json")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        spec = LearnerSpec.load(args.spec)
    except (OSError, ValueError, TypeError) as exc:
        print(f"learner controller: cannot read spec {args.spec}: {exc}", file=sys.stderr)
        return 2
    controller = Controller(spec, EtcdIO(spec.etcd_url))

    def on_term(*_: object) -> None:
        controller.terminate.set()
        controller.wake.set()

    signal.signal(signal.SIGTERM, on_term)
    return controller.run()


if __name__ == "__main__":
    sys.exit(main())
