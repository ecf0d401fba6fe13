"""The production Dockerfiles, checked statically: they need a registry to build, which
the machines running these tests do not reach (so there is no engine test of them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from services.images.build import BASE_IMAGE, LEARNER_UID, REPO_ROOT, offline_dockerfile

DOCKERFILES = {
    "learner": REPO_ROOT / "deploy/docker/Dockerfile.learner",
    "daemon": REPO_ROOT / "deploy/docker/Dockerfile.daemon",
}
COMMANDS = {
    "learner": '["python", "-m", "learner.controller"]',
    "daemon": '["python", "-m", "services.daemon"]',
}
# An official image with a tag pinned to the patch release (no `latest`, no bare `3`).
PINNED_PYTHON = re.compile(r"^python:3\.11\.\d+-slim(-bookworm)?$")
SECRETISH = re.compile(r"SECRET|PASSWORD|PASSWD|TOKEN|ACCESS_KEY|PRIVATE_KEY|CREDENTIAL", re.I)


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    joined = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), " ".join(rest.split())))
    return found


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_dockerfile_is_pinned_official_non_root_and_secret_free(kind: str) -> None:
    steps = instructions(DOCKERFILES[kind].read_text())
    stages: set[str] = set()
    final_stage: list[tuple[str, str]] = []
    for word, args in steps:
        if word == "FROM":
            image, *alias = args.split(" AS ") if " AS " in args else (args,)
            assert image in stages or PINNED_PYTHON.match(image), f"FROM {image}"
            stages.update(a.strip() for a in alias)
            final_stage = []
        final_stage.append((word, args))
    users = [args for word, args in final_stage if word == "USER"]
    assert users, "the final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid not in {"0", "root"} and uid == str(LEARNER_UID)
    assert final_stage[-1] == ("CMD", COMMANDS[kind])
    installs = [args for word, args in steps if word == "RUN" and "pip install" in args]
    assert any("-r requirements.txt" in args for args in installs), "pinned requirements"
    for word, args in steps:
        if word in {"ENV", "ARG", "LABEL"}:
            assert not SECRETISH.search(args), f"{word} {args}"
        if word in {"COPY", "ADD"}:
            assert not re.search(r"\.env\b|id_rsa|\.aws|\.docker/config", args), args
    for source in ("requirements.txt", "protos", "services", "learner"):
        assert (REPO_ROOT / source).exists(), source


def test_build_context_lets_in_only_the_code() -> None:
    lines = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # Everything out first, then only named paths back in: .venv, .git and data
    # directories can never reach a build context.
    assert lines[0] == "*"
    allowed = {line[1:] for line in lines if line.startswith("!")}
    assert allowed <= {"requirements.txt", "protos", "services", "learner", "contract"}


def test_offline_dockerfile_runs_as_the_learner_user_on_the_debootstrap_base() -> None:
    steps = instructions(offline_dockerfile("rhizome-learner:test"))
    assert steps[0] == ("FROM", BASE_IMAGE)
    assert ("USER", f"{LEARNER_UID}:{LEARNER_UID}") in steps
    assert steps[-1] == ("CMD", COMMANDS["learner"])


def test_offline_dockerfile_is_the_same_in_every_process() -> None:
    """The build cache (and the same image id from two `rhizome image build` runs) needs
    a byte-identical Dockerfile, whatever each process's hash seed."""
    script = "from services.images.build import offline_dockerfile; print(offline_dockerfile('t'))"
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO_ROOT,
            env=dict(os.environ, PYTHONHASHSEED=str(seed)),
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(outputs) == 1
