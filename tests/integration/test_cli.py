"""The `rhizome` CLI end to end: up --embedded, train, list/show --json, errors, down, restart."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from contract.procs import pid_alive
from services.embedded.process import ManagedServer

pytestmark = pytest.mark.integration

RHIZOME = [sys.executable, "-m", "services.client.cli"]


def rz(
    data_dir: Path,
    *args: str,
    check: bool = True,
    user: str = "cli-user",
    token: str = "",
    learner_uids: bool = False,
) -> subprocess.CompletedProcess[str]:
    """`rhizome --data-dir DATA_DIR ARGS`: with no token, the CLI finds the embedded
    platform's admin token by itself. `learner_uids`: without the suite's
    `RHIZOME_LEARNER_UIDS=off` (tests/conftest.py), so a platform `up` starts gives each
    job a uid of its own, the default."""
    env = {**os.environ, "RHIZOME_USER": user, "COLUMNS": "200"}
    env.pop("RHIZOME_TOKEN", None)
    if learner_uids:
        env.pop("RHIZOME_LEARNER_UIDS", None)
    if token:
        env["RHIZOME_TOKEN"] = token
    proc = subprocess.run(
        [*RHIZOME, "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"rhizome {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return proc


@contextlib.contextmanager
def embedded_up(data_dir: Path, learner_uids: bool = False) -> Iterator[Path]:
    """`rhizome up --embedded` on free ports in `data_dir`; `rhizome down` at the end.
    `learner_uids`: the platform's default isolation (`rz`)."""
    rz(
        data_dir,
        "up",
        "--embedded",
        "--grpc-port",
        "0",
        "--rest-port",
        "0",
        learner_uids=learner_uids,
    )
    try:
        yield data_dir
    finally:
        rz(data_dir, "down", check=False)


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with embedded_up(Path(tmp_path_factory.mktemp("embedded"))) as data_dir:
        yield data_dir


def write_manifest(tmp_path: Path, body: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "train.py").write_text("print('hello from the learner')\n")
    path = tmp_path / "manifest.yml"
    path.write_text(body)
    return path


def test_train_list_show_json(embedded: Path, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path, "name: cli-job\nframework:\n  command: python train.py\n")
    out = json.loads(rz(embedded, "train", str(manifest), "--json").stdout)
    job_id = out["job_id"]
    listed = json.loads(rz(embedded, "list", "--json").stdout)
    assert job_id in [j["job_id"] for j in listed]
    shown = json.loads(rz(embedded, "show", job_id, "--json").stdout)
    assert shown["job_id"] == job_id and shown["name"] == "cli-job"
    assert shown["history"][0]["status"] == "QUEUED"
    text = rz(embedded, "show", job_id).stdout
    assert job_id in text and "history" in text
    status = json.loads(rz(embedded, "status", "--json").stdout)
    assert status["running"] is True
    assert set(status["components"]) == {"etcd", "mongodb", "elasticsearch", "api"}


def test_the_admin_token_is_0600_in_the_data_dir_and_the_cli_needs_no_flags(
    embedded: Path,
) -> None:
    path = embedded / "admin.token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip().startswith("rz_")
    assert rz(embedded, "list").returncode == 0  # no --token, no $RHIZOME_TOKEN
    proc = rz(embedded, "--token", "rz_wrong", "list", check=False)
    assert proc.returncode == 1 and "unknown token" in proc.stderr


def test_token_create_list_revoke(embedded: Path, tmp_path: Path) -> None:
    created = json.loads(
        rz(embedded, "token", "create", "--user", "bob", "--expires-in", "30d", "--json").stdout
    )
    secret, token_id = created["secret"], created["token"]["token_id"]
    assert secret.startswith("rz_") and created["token"]["user"] == "bob"
    assert created["token"]["role"] == "user" and created["token"]["expires_at"]
    # Plain output: the secret alone on stdout (for `TOKEN=$(rhizome token create ...)`).
    plain = rz(embedded, "token", "create", "--user", "carol", "--role", "admin")
    assert plain.stdout.strip().startswith("rz_") and "not shown again" in plain.stderr
    listed = json.loads(rz(embedded, "token", "list", "--json").stdout)
    assert token_id in [t["token_id"] for t in listed]
    assert secret not in json.dumps(listed) and plain.stdout.strip() not in json.dumps(listed)
    assert "bob" in rz(embedded, "token", "list").stdout
    # bob's token is bob: his own (empty) job list, and no token management.
    assert json.loads(rz(embedded, "list", "--json", token=secret).stdout) == []
    denied = rz(embedded, "token", "list", token=secret, check=False)
    assert denied.returncode == 1 and "not an admin" in denied.stderr
    revoked = json.loads(rz(embedded, "token", "revoke", token_id, "--json").stdout)
    assert revoked["token_id"] == token_id and revoked["revoked_at"]
    gone = rz(embedded, "list", token=secret, check=False)
    assert gone.returncode == 1 and "revoked" in gone.stderr
    bad = rz(embedded, "token", "create", "--expires-in", "soon", check=False)
    assert bad.returncode == 2 and "30d" in bad.stderr


def test_errors_exit_non_zero_with_one_clear_line(embedded: Path, tmp_path: Path) -> None:
    bad = write_manifest(tmp_path, "name: x\nframework: {command: c}\nlearners: 0\n")
    proc = rz(embedded, "train", str(bad), check=False)
    assert proc.returncode == 1
    assert "learners: 0 is less than the minimum of 1" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = rz(embedded, "show", "job-nope", check=False)
    assert proc.returncode == 1 and "no job 'job-nope'" in proc.stderr
    proc = rz(embedded, "train", str(tmp_path / "missing.yml"), check=False)
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_an_unreachable_api_is_named(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*RHIZOME, "--api", "127.0.0.1:1", "list"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1
    assert "cannot reach the Rhizome API at 127.0.0.1:1" in proc.stderr


def test_down_stops_everything_by_pid_and_data_survives_up(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with embedded_up(Path(tmp_path_factory.mktemp("restart"))) as data_dir:
        manifest = write_manifest(
            data_dir / "job", "name: survives\nframework:\n  command: python train.py\n"
        )
        job_id = json.loads(rz(data_dir, "train", str(manifest), "--json").stdout)["job_id"]
        pids = [
            c["pid"]
            for c in json.loads(rz(data_dir, "status", "--json").stdout)["components"].values()
        ]
        rz(data_dir, "down")
        assert not any(pid_alive(p) for p in pids)
        assert rz(data_dir, "status", check=False).returncode != 0
        rz(data_dir, "up", "--embedded", "--grpc-port", "0", "--rest-port", "0")
        shown = json.loads(rz(data_dir, "show", job_id, "--json").stdout)
        assert shown["name"] == "survives"


def test_up_with_external_servers_uses_them(
    tmp_path: Path,
    etcd_server: ManagedServer,
    mongo_server: ManagedServer,
    es_server: ManagedServer,
) -> None:
    rz(
        tmp_path,
        "up",
        "--etcd",
        etcd_server.url,
        "--mongodb-uri",
        mongo_server.url,
        "--elasticsearch-url",
        es_server.url,
        "--grpc-port",
        "0",
        "--rest-port",
        "0",
    )
    try:
        status = json.loads(rz(tmp_path, "status", "--json").stdout)
        assert set(status["components"]) == {"api"}
        assert status["urls"]["mongodb"] == mongo_server.url
        assert json.loads(rz(tmp_path, "version", "--json").stdout)["server"]["api"] == "rhizome.v1"
    finally:
        rz(tmp_path, "down", check=False)


def test_a_daemon_crash_restarts_only_the_daemon(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with embedded_up(Path(tmp_path_factory.mktemp("crash"))) as data_dir:
        manifest = write_manifest(data_dir / "job", "name: crash\nframework:\n  command: 'true'\n")
        job_id = json.loads(rz(data_dir, "train", str(manifest), "--json").stdout)["job_id"]
        before = json.loads(rz(data_dir, "status", "--json").stdout)["components"]
        os.killpg(before["api"]["pid"], signal.SIGKILL)
        # The supervisor of `up` starts the daemon again (tests/integration/test_supervision.py).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            now = json.loads(rz(data_dir, "status", "--json", check=False).stdout)
            if now["running"] and now["components"]["api"]["pid"] != before["api"]["pid"]:
                break
            time.sleep(0.2)
        rz(data_dir, "up", "--embedded")  # finds it running: starts nothing
        after = json.loads(rz(data_dir, "status", "--json").stdout)["components"]
        assert after["api"]["restarts"] == 1
        for dep in ("etcd", "mongodb", "elasticsearch"):
            assert after[dep]["pid"] == before[dep]["pid"], f"{dep} was restarted"
        assert after["api"]["pid"] != before["api"]["pid"]
        assert json.loads(rz(data_dir, "show", job_id, "--json").stdout)["job_id"] == job_id


def test_train_validates_the_manifest_before_packaging_anything(
    embedded: Path, tmp_path: Path
) -> None:
    import socket

    folder = tmp_path / "home"
    bad = write_manifest(folder, "name: x\nframework: {command: c}\nlearners: 0\n")
    # A socket in the folder would break zipping; the bad manifest is reported first.
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(folder / "agent.sock"))
    try:
        proc = rz(embedded, "train", str(bad), check=False)
        assert proc.returncode == 1 and "learners: 0 is less than the minimum" in proc.stderr
        assert "packaging" not in proc.stderr
        good = write_manifest(folder, "name: x\nframework: {command: python train.py}\n")
        proc = rz(embedded, "train", str(good), check=False)
    finally:
        sock.close()
    assert proc.returncode == 1
    assert f"{folder / 'agent.sock'} is not a regular file" in proc.stderr
    assert "rhizome train MANIFEST CODE_DIR" in proc.stderr and "Traceback" not in proc.stderr


def test_train_says_what_it_packages_and_uploads(embedded: Path, tmp_path: Path) -> None:
    manifest = write_manifest(tmp_path / "code", "name: x\nframework: {command: python train.py}\n")
    proc = rz(embedded, "train", str(manifest))
    assert f"packaging {tmp_path / 'code'}" in proc.stderr
    assert "uploading 0.0 MiB of code" in proc.stderr


def test_halt_resume_delete_print_the_state_they_produced(embedded: Path, tmp_path: Path) -> None:
    manifest = write_manifest(
        tmp_path / "code",
        "name: sleeper\nframework: {command: 'python -c \"import time; time.sleep(600)\"'}\n",
    )
    job_id = json.loads(rz(embedded, "train", str(manifest), "--json").stdout)["job_id"]
    deadline = time.monotonic() + 90
    while json.loads(rz(embedded, "show", job_id, "--json").stdout)["status"] != "PROCESSING":
        assert time.monotonic() < deadline, "the job never reached PROCESSING"
        time.sleep(0.5)
    halted = rz(embedded, "halt", job_id)
    assert halted.stdout.strip() == f"job {job_id} HALTED"  # not the PROCESSING it had
    resumed = json.loads(rz(embedded, "resume", job_id, "--json").stdout)
    assert resumed["status"] != "HALTED"
    deleted = rz(embedded, "delete", job_id)
    assert deleted.stdout.strip() == f"job {job_id} DELETED"


def test_a_unique_id_prefix_works_everywhere_and_an_ambiguous_one_lists_the_candidates(
    embedded: Path, tmp_path: Path
) -> None:
    manifest = write_manifest(tmp_path / "code", "name: p\nframework: {command: 'true'}\n")
    user = "prefix-user"
    ids = [
        json.loads(rz(embedded, "train", str(manifest), "--json", user=user).stdout)["job_id"]
        for _ in range(2)
    ]
    differ = next(i for i, (a, b) in enumerate(zip(*ids, strict=True)) if a != b)
    common = ids[0][:differ]
    # The newer id's prefix one character past the shared part is unique: ids sort by
    # creation, so any older job sharing it would also share it with ids[0].
    unique = ids[1][: differ + 1]
    shown = json.loads(rz(embedded, "show", unique, "--json", user=user).stdout)
    assert shown["job_id"] == ids[1]
    ambiguous = rz(embedded, "show", common, check=False, user=user)
    assert ambiguous.returncode == 1
    assert "is the start of" in ambiguous.stderr and "give more of it" in ambiguous.stderr
    assert ids[0] in ambiguous.stderr and ids[1] in ambiguous.stderr
    listed = rz(embedded, "list", user=user).stdout
    assert all(i in listed for i in ids)  # whole, not cut


def test_train_shows_upload_progress_for_large_code(embedded: Path, tmp_path: Path) -> None:
    # 3 MiB that does not compress, sent in 1 MiB pieces and reported as they go (a line
    # per quarter when stderr is not a terminal, as here).
    manifest = write_manifest(
        tmp_path / "code", "name: big\nframework: {command: python train.py}\n"
    )
    (tmp_path / "code" / "weights.bin").write_bytes(os.urandom(3 * 2**20))
    proc = rz(embedded, "train", str(manifest))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("uploaded ")]
    assert lines[-1] == "uploaded 3.0 of 3.0 MiB", proc.stderr
    # a line per quarter crossed, at most one per piece: the archive is a little over
    # 3 MiB (zip headers), so 4 pieces cross the 4 quarters
    assert lines == [
        "uploaded 1.0 of 3.0 MiB",
        "uploaded 2.0 of 3.0 MiB",
        "uploaded 3.0 of 3.0 MiB",
        "uploaded 3.0 of 3.0 MiB",
    ]
