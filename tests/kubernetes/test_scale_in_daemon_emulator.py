"""`rhizome scale JOB N` down through the daemon with `--backend kubernetes`, against
EMULATORS (kmock as the API server, tests/kubernetes/kubelet.py as the kubelets; see
test_daemon_emulator.py): the retired rank's pod is deleted (its command gets SIGTERM),
the other learner's pod runs on, and the job is PROCESSING on fewer learners."""

from __future__ import annotations

import pytest

from services.store import states
from tests.kubernetes.test_daemon_emulator import (  # noqa: F401 (a fixture)
    STEPPER,
    K8sPlatform,
    platform,
)
from tests.services.guardian.helpers import code_zip, wait_for

pytestmark = [pytest.mark.kubernetes, pytest.mark.integration]

MANIFEST = (
    "name: k8s-scale-in\nlearners: 2\nmemory: 256MiB\ncpus: 0.5\n"
    "elastic: {min: 1, max: 2}\nframework:\n  command: 'STEPS=600 sh run.sh'\n"
)


def running_pods(k8s: K8sPlatform, job_id: str) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in k8s.pods(job_id)
        if (p.get("status") or {}).get("phase") == "Running"
        and not p["metadata"].get("deletionTimestamp")
    )


def test_emulator_scale_in_deletes_the_retired_ranks_pod_and_the_job_runs_on(
    platform: K8sPlatform,  # noqa: F811 (the fixture imported above)
) -> None:
    platform.start()
    with platform.client() as c:
        job_id = c.create_job(MANIFEST, code_zip({"run.sh": STEPPER})).job_id
        try:
            platform.wait_status(job_id, {states.PROCESSING}, 120)

            def both_running() -> list[str] | None:
                pods = running_pods(platform, job_id)
                return pods if len(pods) == 2 else None

            pods = wait_for("both pods running", both_running, 120)
            c.scale_job(job_id, 1)
            record = wait_for(
                "the scale-in applied",
                lambda: next(
                    (
                        r
                        for r in [platform.jobs.get(job_id)]
                        if any("scaled 2 → 1 learners" in h.message for h in r.history)
                    ),
                    None,
                ),
                90,
            )
            assert record.status == states.PROCESSING
            assert int(record.resources["learners"]) == 1
            retired = next(p for p in pods if f"{job_id}-1-" in p)
            assert platform.kubelet.signals.get(retired) == ["SIGTERM"]
            wait_for("rank 1's pod gone", lambda: running_pods(platform, job_id) == [pods[0]], 30)
        finally:
            c.delete_job(job_id)
            # ended before the daemon stops: its guardian is not stopped mid-delete
            platform.wait_status(job_id, {states.DELETED}, 60)
