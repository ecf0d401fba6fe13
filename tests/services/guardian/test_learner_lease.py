"""The learners' etcd lease TTL is the platform's setting (`RHIZOME_LEARNER_LEASE_TTL_S`,
default 10 s; docs/lifecycle.md "The learners' lease"): the guardian passes it in every
learner's spec, and the controller's status key lives under a lease of that TTL. A value
outside 2-60 s is refused naming the variable, by a guardian and by the LCM at the
daemon's start. Real etcd and MongoDB-wire server, guardian processes, real learner
controllers on the local backend."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import pytest

from contract import etcd_keys
from contract.learner_spec import DEFAULT_LEARNER_LEASE_TTL_S, LearnerSpec
from contract.status import ExitCode
from services.guardian.config import LEARNER_LEASE_TTL_ENV, learner_lease_ttl_from_env
from services.store import states
from tests.services.guardian.helpers import job_report, start_guardian, submit, wait_for


def test_the_setting_is_a_whole_number_of_seconds_from_2_to_60() -> None:
    assert DEFAULT_LEARNER_LEASE_TTL_S == 10
    assert learner_lease_ttl_from_env({}) == 10
    assert learner_lease_ttl_from_env({LEARNER_LEASE_TTL_ENV: " "}) == 10  # unset
    assert learner_lease_ttl_from_env({LEARNER_LEASE_TTL_ENV: "2"}) == 2
    assert learner_lease_ttl_from_env({LEARNER_LEASE_TTL_ENV: "60"}) == 60
    for bad in ("1", "61", "0", "-5", "ten", "2.5"):
        with pytest.raises(ValueError, match=r"\$RHIZOME_LEARNER_LEASE_TTL_S is .*2 to 60"):
            learner_lease_ttl_from_env({LEARNER_LEASE_TTL_ENV: bad})


def test_the_lcm_refuses_a_bad_setting_at_the_daemon_s_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused before the LCM is built: not by each guardian it would start (each would
    exit with a usage error, and be restarted, and exit again)."""
    from services.lcm.hosting import build

    monkeypatch.setenv(LEARNER_LEASE_TTL_ENV, "1")
    ctx = SimpleNamespace(config=SimpleNamespace(etcd_url="http://127.0.0.1:1"))
    with pytest.raises(click.UsageError, match="RHIZOME_LEARNER_LEASE_TTL_S is '1'"):
        build(ctx)  # type: ignore[arg-type]


def controller_lease_ttl(stores: dict[str, Any], job_id: str) -> int | None:
    """The TTL etcd granted the lease learner 0's status key is under, once PROCESSING."""
    entry = stores["etcd"].get(etcd_keys.learner_status(job_id, 0))
    if entry is None or not isinstance(entry.value, dict) or not entry.lease:
        return None
    if entry.value.get("status") != "PROCESSING":
        return None
    return int(stores["etcd"].raw.get_lease_info(entry.lease).grantedTTL)


@pytest.mark.integration
def test_a_learner_s_controller_holds_its_status_under_the_platform_s_lease_ttl(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    """Two jobs, a guardian process each: one with the setting (7 s), one without (the
    default). Each controller's spec says its TTL, and etcd granted its lease that TTL
    (before the setting: 2 s for every learner)."""
    set_to_7 = submit(stores["repo"], tmp_path, "sleep 120").job_id
    default = submit(stores["repo"], tmp_path, "sleep 120").job_id
    ids = [set_to_7, default]
    guardians: list[subprocess.Popen[bytes]] = []

    def report() -> str:
        return "\n".join(job_report(stores["repo"], j, tmp_path) for j in ids)

    try:
        for job_id, setting in ((set_to_7, "7"), (default, "")):  # "": unset
            guardian = start_guardian(
                job_id,
                stores["etcd_url"],
                stores["mongo_url"],
                tmp_path,
                **{LEARNER_LEASE_TTL_ENV: setting},
            )
            guardians.append(guardian)
        ttls = {
            job_id: wait_for(
                f"{job_id}'s controller PROCESSING under its lease",
                lambda job_id=job_id: controller_lease_ttl(stores, job_id),  # type: ignore[misc]
                explain=report,
            )
            for job_id in ids
        }
        assert ttls == {set_to_7: 7, default: DEFAULT_LEARNER_LEASE_TTL_S}, report()
        for job_id, ttl in ttls.items():
            spec = LearnerSpec.load(tmp_path / "jobs" / job_id / "learners" / "0" / "spec.json")
            assert spec.lease_ttl_s == ttl
        for job_id in ids:
            stores["etcd"].put(etcd_keys.control(job_id), {"action": "delete", "reason": "test"})
        for guardian in guardians:
            assert guardian.wait(timeout=60) == 0, report()
        assert all(stores["repo"].get(j).status == states.DELETED for j in ids)
    finally:
        for guardian in guardians:
            if guardian.poll() is None:
                guardian.kill()
                guardian.wait()


@pytest.mark.integration
def test_a_guardian_refuses_a_bad_setting_naming_the_variable(
    stores: dict[str, Any], tmp_path: Path
) -> None:
    job_id = submit(stores["repo"], tmp_path, "true").job_id
    guardian = start_guardian(
        job_id,
        stores["etcd_url"],
        stores["mongo_url"],
        tmp_path,
        **{LEARNER_LEASE_TTL_ENV: "90"},
    )
    assert guardian.wait(timeout=60) == ExitCode.USAGE
    logs = "".join(p.read_text() for p in tmp_path.glob(f"guardian-{job_id}-*.log"))
    assert "$RHIZOME_LEARNER_LEASE_TTL_S is '90'" in logs, logs
    assert stores["repo"].get(job_id).status == states.PENDING  # nothing was deployed
