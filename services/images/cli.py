"""`rhizome image …`: build the images the docker backend runs (logic in build.py)."""

from __future__ import annotations

import json
import sys

import click
from rich.console import Console

from services.images.build import ImageBuildError, build_learner_image

err = Console(stderr=True, highlight=False, soft_wrap=True)


@click.group(name="image")
def image() -> None:
    """Build the container images the docker backend runs."""


@image.command()
@click.option(
    "--offline/--registry",
    "offline",
    default=None,
    help="Build from a debootstrap base without a registry, or from deploy/docker/"
    "Dockerfile.learner with one (default: offline when no registry answers).",
)
@click.option(
    "--docker-host",
    envvar="DOCKER_HOST",
    default=None,
    metavar="URL",
    help="The engine to build in (default: $DOCKER_HOST, else unix:///var/run/docker.sock).",
)
@click.option("--rebuild-base", is_flag=True, help="Run debootstrap again even if cached.")
@click.option("--json", "as_json", is_flag=True, help="Print the image id and tag as JSON.")
def build(offline: bool | None, docker_host: str | None, rebuild_base: bool, as_json: bool) -> None:
    """Build the learner image rhizome-learner:<version>."""

    def progress(line: str) -> None:
        # Progress on stderr so that stdout holds only the result (JSON with --json).
        err.print(line)

    try:
        result = build_learner_image(offline, progress, docker_host, rebuild_base)
    except ImageBuildError as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
    if as_json:
        click.echo(json.dumps(result.as_dict(), indent=2, sort_keys=True))
    else:
        click.echo(f"built {result.tag} ({result.image_id}) in {result.seconds:.1f} s")
