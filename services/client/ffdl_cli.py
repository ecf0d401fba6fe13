"""`rhizome download` and `rhizome events …`: FfDL's model downloads and job events
(webhooks), over the SDK (docs/api.md)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import click
from rich.table import Table

from services.client.cli import (
    Ctx,
    emit_json,
    err,
    fmt_time,
    handles_errors,
    job_id_argument,
    json_option,
    out,
    to_dict,
)
from services.client.sdk import ClientError


@click.command(name="download")
@job_id_argument
@click.option(
    "--definition",
    is_flag=True,
    help="The code archive the job was submitted with, instead of its trained model.",
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Where to write the zip ('-': stdout). Default: JOB-trained.zip / JOB-definition.zip.",
)
@click.option("--force", is_flag=True, help="Overwrite OUTPUT if it exists.")
@json_option
@click.pass_obj
@handles_errors
def download(
    obj: Ctx, job_id: str, definition: bool, output: Path | None, force: bool, as_json: bool
) -> None:
    """Download a job's trained model (what its learners stored as results, a zip of
    RANK/PATH) or, with --definition, its model definition."""
    fetch = (
        obj.client.download_model_definition if definition else obj.client.download_trained_model
    )
    what = "model definition" if definition else "trained model"
    if output is not None and str(output) == "-":
        size = fetch(job_id, sys.stdout.buffer)
        sys.stdout.buffer.flush()
        if not as_json:
            err.print(f"{what} of {job_id}: {size} bytes")
        return
    target = output or Path(f"{job_id}-{'definition' if definition else 'trained'}.zip")
    if target.exists() and not force:
        raise ClientError(
            "ALREADY_EXISTS", f"{target} exists; pass --force to overwrite it or -o another file"
        )
    # Written beside the target and renamed at the end: a failed download leaves no
    # half-written file under the name asked for.
    partial = target.with_name(f".{target.name}.part-{os.getpid()}")
    try:
        with open(partial, "wb") as fh:
            size = fetch(job_id, fh)
        partial.replace(target)
    except OSError as exc:
        raise ClientError("INVALID_ARGUMENT", f"cannot write {target}: {exc.strerror}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            partial.unlink()
    if as_json:
        emit_json({"job_id": job_id, "what": what, "path": str(target), "bytes": size})
    else:
        out.print(f"{what} of {job_id}: {size} bytes written to {target}")


@click.group(name="events")
def events() -> None:
    """Webhooks called on a job's status changes (FfDL's events; docs/api.md)."""


@events.command("add")
@job_id_argument
@click.argument("event_type")
@click.argument("url")
@click.option("--id", "endpoint_id", default="", help="Name the endpoint (default: generated).")
@json_option
@click.pass_obj
@handles_errors
def events_add(
    obj: Ctx, job_id: str, event_type: str, url: str, endpoint_id: str, as_json: bool
) -> None:
    """Call URL on the job's EVENT_TYPE: `status` (every status change) or a status such
    as `completed`. Prints the signing secret once, on stdout."""
    resp = obj.client.create_event_endpoint(job_id, event_type, url, endpoint_id)
    if as_json:
        emit_json(to_dict(resp))
        return
    e = resp.endpoint
    err.print(f"endpoint {e.endpoint_id} on {e.job_id} {e.event_type} -> {e.url}; signing secret:")
    click.echo(resp.secret)
    err.print(
        "[yellow]Store it now: it is not shown again.[/yellow] Each delivery carries "
        "X-Rhizome-Signature: sha256=HMAC-SHA256(secret, body)."
    )


@events.command("list")
@job_id_argument
@click.argument("event_type", required=False, default="")
@json_option
@click.pass_obj
@handles_errors
def events_list(obj: Ctx, job_id: str, event_type: str, as_json: bool) -> None:
    """The job's webhooks (of EVENT_TYPE, default every type), never their secrets."""
    found = obj.client.list_event_endpoints(job_id, event_type)
    if as_json:
        emit_json([to_dict(e) for e in found])
        return
    table = Table("id", "event", "url", "created")
    for e in found:
        table.add_row(e.endpoint_id, e.event_type, e.url, fmt_time(e.created_at))
    out.print(table if found else f"no event endpoints on {job_id}")


@events.command("rm")
@job_id_argument
@click.argument("event_type")
@click.argument("endpoint_id")
@json_option
@click.pass_obj
@handles_errors
def events_rm(obj: Ctx, job_id: str, event_type: str, endpoint_id: str, as_json: bool) -> None:
    """Delete a webhook: no further deliveries to it."""
    e = obj.client.delete_event_endpoint(job_id, event_type, endpoint_id)
    if as_json:
        emit_json(to_dict(e))
    else:
        out.print(f"endpoint {e.endpoint_id} ({e.event_type} -> {e.url}) deleted")
