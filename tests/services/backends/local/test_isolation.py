"""The local backend's learner users and its link-refusing file access (no platform)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from services.backends.local import isolation
from services.backends.local.isolation import IsolationConfig, IsolationError, LearnerUser


def test_config_defaults_to_per_job_uids_only_for_root() -> None:
    assert IsolationConfig.from_env({}, root=True).uid_range == isolation.DEFAULT_UID_RANGE
    assert IsolationConfig.from_env({}, root=False).uid_range is None
    assert IsolationConfig.from_env({"RHIZOME_LEARNER_UIDS": "off"}, root=True).uid_range is None
    ranged = IsolationConfig.from_env({"RHIZOME_LEARNER_UIDS": "40000-40009"}, root=True)
    assert ranged.uid_range == (40000, 40009)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("lots", "must be auto, off or FIRST-LAST"),
        ("30-40", "above the system accounts"),
        ("50000-40000", "first <= last"),
    ],
)
def test_config_names_a_bad_setting_and_the_fix(value: str, says: str) -> None:
    with pytest.raises(IsolationError, match="RHIZOME_LEARNER_UIDS") as err:
        IsolationConfig.from_env({"RHIZOME_LEARNER_UIDS": value}, root=True)
    assert says in str(err.value)


def test_a_range_without_root_says_root_is_needed() -> None:
    with pytest.raises(IsolationError, match="needs the daemon to run as root"):
        IsolationConfig.from_env({"RHIZOME_LEARNER_UIDS": "40000-40009"}, root=False)


@pytest.fixture(autouse=True)
def _machine_marks_of_this_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the machine-wide marks of these tests only: other tests' claims must not count here
    monkeypatch.setenv(isolation.MACHINE_CLAIMS_VARIABLE, str(tmp_path / "machine-marks"))


def test_another_platform_on_the_machine_never_gets_the_same_uid(tmp_path: Path) -> None:
    one, other = tmp_path / "one" / "jobs", tmp_path / "other" / "jobs"
    assert isolation.claim_uid(one, "job-a", 40000, 40001) == 40000
    # another data directory, nothing in its own claims: it must still skip 40000
    assert isolation.claim_uid(other, "job-a", 40000, 40001) == 40001
    with pytest.raises(IsolationError, match="every learner uid of 40000-40000 is claimed"):
        isolation.claim_uid(other, "job-b", 40000, 40000)


def test_a_uid_released_by_one_platform_is_free_for_another(tmp_path: Path) -> None:
    one, other = tmp_path / "one" / "jobs", tmp_path / "other" / "jobs"
    isolation.claim_uid(one, "job-a", 40000, 40000)
    assert isolation.release_uid(one, "job-a", [], lambda uid: None) == 40000
    assert isolation.claim_uid(other, "job-b", 40000, 40000) == 40000


def test_a_mark_whose_data_directory_is_gone_is_taken_over(tmp_path: Path) -> None:
    one, other = tmp_path / "one" / "jobs", tmp_path / "other" / "jobs"
    isolation.claim_uid(one, "job-a", 40000, 40000)
    shutil.rmtree(tmp_path / "one")  # a platform whose data directory was deleted
    assert isolation.claim_uid(other, "job-b", 40000, 40000) == 40000
    mark = tmp_path / "machine-marks" / "40000"
    assert mark.read_text() == str(other.resolve())


def test_uids_are_one_per_job_reused_and_exhaustion_is_named(tmp_path: Path) -> None:
    first = isolation.claim_uid(tmp_path, "job-a", 40000, 40001)
    second = isolation.claim_uid(tmp_path, "job-b", 40000, 40001)
    assert {first, second} == {40000, 40001}
    # A restarted guardian (a new process, nothing cached) finds the same uid again.
    assert isolation.claim_uid(tmp_path, "job-a", 40000, 40001) == first
    assert isolation.claimed_uid(tmp_path, "job-b") == second
    assert (tmp_path / ".uids").stat().st_mode & 0o077 == 0
    with pytest.raises(IsolationError, match="every learner uid of 40000-40001 is claimed"):
        isolation.claim_uid(tmp_path, "job-c", 40000, 40001)


def test_uids_of_existing_accounts_are_never_handed_out(tmp_path: Path) -> None:
    # uid 0 is always an account; a range starting there skips it.
    assert isolation.claim_uid(tmp_path, "job-a", 0, 70000) != 0


def test_unreachable_names_the_directory_that_stops_a_user(tmp_path: Path) -> None:
    stranger = LearnerUser(54321, 54321)
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    (tmp_path / "a").chmod(0o700)
    tmp_path.chmod(0o711)
    blocked = isolation.unreachable(inner, stranger)
    # Whatever stops it above tmp_path (pytest's own 0700 directories) comes first.
    assert blocked is not None and blocked in [*inner.parents, inner]
    (tmp_path / "a").chmod(0o711)
    assert isolation.unreachable(inner, LearnerUser(os.getuid(), os.getgid())) is None


def test_writes_replace_a_planted_link_instead_of_following_it(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    job = tmp_path / "job"
    (job / "learners" / "0").mkdir(parents=True)
    (job / "learners" / "0" / "spec.json").symlink_to(victim)
    isolation.write_file(job, ["learners", "0"], "spec.json", b"{}", 0o600, None)
    assert victim.read_text() == "precious\n"
    assert (job / "learners" / "0" / "spec.json").read_text() == "{}"
    assert not (job / "learners" / "0" / "spec.json").is_symlink()


def test_a_linked_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    job = tmp_path / "job"
    job.mkdir()
    (job / "learners").symlink_to(elsewhere)
    with pytest.raises(isolation.UnsafePath, match="is a link or not a directory"):
        isolation.write_file(job, ["learners", "0"], "spec.json", b"{}", 0o600, None)
    assert list(elsewhere.iterdir()) == []


def test_appends_and_tails_refuse_links_to_other_files(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's secret\n")
    job = tmp_path / "job"
    (job / "l").mkdir(parents=True)
    (job / "l" / "controller.log").symlink_to(victim)
    with pytest.raises(isolation.UnsafePath, match="is a link"):
        isolation.open_append(job, ["l"], "controller.log", None)
    (job / "l" / "stderr.log").symlink_to(victim)
    with pytest.raises(isolation.UnsafePath, match="is a link"):
        isolation.read_tail(job, ["l"], "stderr.log", 100)
    os.link(victim, job / "l" / "stdout.log")  # a hard link: not a file of its own
    with pytest.raises(isolation.UnsafePath, match="not a plain file of its own"):
        isolation.read_tail(job, ["l"], "stdout.log", 100)
    assert victim.read_text() == "root's secret\n"
    assert isolation.read_tail(job, ["l"], "missing.log", 100) == b""


def test_tail_reads_only_the_end(tmp_path: Path) -> None:
    (tmp_path / "l").mkdir()
    (tmp_path / "l" / "out.log").write_bytes(b"x" * 1000 + b"end\n")
    assert isolation.read_tail(tmp_path, ["l"], "out.log", 4) == b"end\n"


def test_up_is_told_when_auto_would_run_the_learners_as_root() -> None:
    """`auto` falls back to the daemon's user where learner uids cannot reach the data
    directory; as root that means learners run as root, which `rhizome up` must say (the
    backend's warning reaches only a guardian host's log)."""
    if os.geteuid() != 0:
        pytest.fail("this test needs root: only root's `auto` switches learners to uids")
    base = Path(tempfile.mkdtemp(prefix="rhizome-fallback-"))  # pytest's own are 0700
    try:
        base.chmod(0o711)
        closed = base / "home"
        closed.mkdir(mode=0o700)
        data_dir = closed / "rhizome"
        said = isolation.data_dir_fallback(data_dir, {})
        assert said is not None
        assert f"cannot enter {closed} on the way to the data directory {data_dir}" in said
        assert f"chmod o+x {closed}" in said and "--data-dir /var/lib/rhizome" in said
        closed.chmod(0o711)  # the uids can pass now
        assert isolation.data_dir_fallback(data_dir, {}) is None
        # Off, or a range asked for (a deploy then fails instead of falling back).
        closed.chmod(0o700)
        off = {isolation.UIDS_VARIABLE: "off"}
        assert isolation.data_dir_fallback(data_dir, off) is None
        ranged = {isolation.UIDS_VARIABLE: "20000-20099"}
        assert isolation.data_dir_fallback(data_dir, ranged) is None
    finally:
        shutil.rmtree(base, ignore_errors=True)
