"""`rhizome scale JOB N`: resize an elastic job (manifest `elastic: {min, max}`).

A queued or halted job changes the size it will be deployed with. A PROCESSING job is
scaled while it trains (docs/elastic.md): the command waits, printing each step, until
the job runs on N learners or its history says why the change was rolled back.
"""

from __future__ import annotations

import sys
import time

import click

from services.client.cli import (
    Ctx,
    emit_json,
    err,
    handles_errors,
    job_id_argument,
    json_option,
    out,
    status_name,
    to_dict,
)

_SETTLED = ("PROCESSING", "QUEUED", "HALTED")


@click.command(name="scale")
@job_id_argument
@click.argument("learners", type=int)
@click.option("--no-wait", is_flag=True, help="Print the state right after the request.")
@click.option("--timeout", type=float, default=120.0, show_default=True, help="Seconds to wait.")
@json_option
@click.pass_obj
@handles_errors
def scale(
    obj: Ctx, job_id: str, learners: int, no_wait: bool, timeout: float, as_json: bool
) -> None:
    """Scale an elastic job to LEARNERS learners (within its manifest's elastic bounds)."""
    before = len(obj.client.get_job(job_id).history)
    job = obj.client.scale_job(job_id, learners)
    deadline = time.monotonic() + timeout
    shown = len(job.history)
    while not no_wait and not (
        status_name(job.status) in _SETTLED
        and (
            job.resources.learners == learners
            or any("rolled back" in e.message for e in job.history[before:])
        )
    ):
        if status_name(job.status) not in (*_SETTLED, "RESCALING"):
            break  # it ended or failed meanwhile; what it says is printed below
        if time.monotonic() > deadline:
            err.print(
                f"job {job.job_id} is {status_name(job.status)} on {job.resources.learners} "
                f"learners after {timeout:.0f} s; the request stands: follow it with "
                f"`rhizome show {job.job_id}`"
            )
            sys.exit(2)
        if not as_json:
            for event in job.history[max(shown, before) :]:
                err.print(f"  {time.strftime('%H:%M:%S')} {event.message}", markup=False)
        shown = len(job.history)
        time.sleep(0.3)
        job = obj.client.get_job(job.job_id)
    if as_json:
        emit_json(to_dict(job))
        return
    for event in job.history[max(shown, before) :]:
        err.print(f"  {time.strftime('%H:%M:%S')} {event.message}", markup=False)
    out.print(f"job {job.job_id} {status_name(job.status)}, {job.resources.learners} learners")
    if job.resources.learners != learners and not no_wait:
        sys.exit(1)
