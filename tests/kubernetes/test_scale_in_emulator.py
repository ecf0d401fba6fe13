"""Scale-in on the kubernetes backend, against the Kubernetes API emulator (kmock; no
kubelet, no real cluster): `stop_learner`, which the guardian's ElasticScaler calls for
`rhizome scale JOB N` down, deletes the retired rank's pod with the job's grace and leaves
the other ranks' pods running."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.backends.kubernetes.spec import pod_name
from tests.kubernetes.conftest import Cluster, deploy, make_job, set_pod_status
from tests.kubernetes.emulator import Emulator

pytestmark = pytest.mark.kubernetes


def test_emulator_stop_learner_deletes_only_that_ranks_pod_with_the_grace(
    cluster: Cluster, emulator: Emulator, tmp_path: Path
) -> None:
    backend = cluster.backend()
    job = make_job(tmp_path, learners=3)
    deploy(backend, job)
    names = [pod_name(job.job_id, rank, job.generation, 0) for rank in range(3)]
    for name in names:
        set_pod_status(cluster.api(), cluster.settings.namespace, name, "Running")
    backend.stop_learner(job.job_id, 2, grace_s=2.5)
    left = sorted(p["metadata"]["name"] for p in cluster.objects("pods", job.job_id))
    assert left == names[:2]
    deletes = [r for r in emulator.km._requests if str(r.method).upper().endswith("DELETE")]
    assert [str(r.url).rsplit("/", 1)[-1].split("?")[0] for r in deletes] == [names[2]]
    assert any(
        r.params.get("gracePeriodSeconds") == "3" or (r.data or {}).get("gracePeriodSeconds") == 3
        for r in deletes
    )
