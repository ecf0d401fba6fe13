"""`rhizome`: the command-line client. It talks only to the public Trainer API (through
services.client.sdk), except `up`/`down`/`status`, which manage the embedded platform.

click parses the command line and rich draws tables and progress: neither is ours to write.
Every command that reads has `--json`; errors print one line on stderr and exit non-zero.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
from google.protobuf.message import Message
from rhizome.v1 import job_pb2, tds_pb2
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from services.client.cost import for_job as job_cost
from services.client.json_view import message_dict
from services.client.options import (
    Ctx,
    add_global_options,
    defaults_for,
    global_options,
    json_option,
)
from services.client.sdk import UPLOAD_CHUNK, Client, ClientError, zip_directory
from services.client.stages import print_stage_table, stage_rows
from services.client.up_summary import print_up_summary
from services.config import DEFAULT_DATA_DIR
from services.lcm.hosting import guardians_per_host_option
from services.manifest import ManifestError, parse_manifest
from services.tds.render import latest_values, plot_metrics

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)
F = TypeVar("F", bound=Callable[..., Any])
TERMINAL = {"COMPLETED", "FAILED", "DELETED", "HALTED"}


def status_name(value: int) -> str:
    return str(job_pb2.JobStatus.Name(value))  # type: ignore[arg-type]


def to_dict(msg: Message) -> dict[str, Any]:
    return message_dict(msg)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=True))


def fmt_time(ts: Any) -> str:
    if not ts.seconds and not ts.nanos:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts.seconds))


def fmt_bytes(n: int) -> str:
    """`512 B`, `3.2 MB`, `1.5 GB`: a checkpoint's size (decimal units, as disks are sold)."""
    size = float(n)
    for unit in ("B", "kB", "MB"):
        if size < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


def handles_errors(fn: F) -> F:
    """One line on stderr and exit 1 for every expected failure; never a traceback."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            err.print(f"[red]error:[/red] {exc.message}")
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper  # type: ignore[return-value]


def resolve_job_id(client: Client, given: str) -> str:
    """`given` itself when it is one of your jobs, else the one job id it is a unique
    prefix of; an ambiguous prefix is an error listing the candidates."""
    try:
        return client.get_job(given).job_id
    except ClientError as exc:
        if exc.code != "NOT_FOUND":
            raise
        matches = [j.job_id for j in client.iter_jobs() if j.job_id.startswith(given)]
        if len(matches) == 1:
            return matches[0]
        if not matches:
            raise
        shown = ", ".join(matches[:10]) + (" ..." if len(matches) > 10 else "")
        raise ClientError(
            "INVALID_ARGUMENT",
            f"{given!r} is the start of {len(matches)} job ids ({shown}); give more of it",
        ) from None


def _job_id_argument(ctx: click.Context, _param: click.Parameter, value: str) -> str:
    try:
        return resolve_job_id(ctx.obj.client, value)
    except ClientError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        sys.exit(1)


job_id_argument = click.argument("job_id", callback=_job_id_argument)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@global_options
@click.pass_context
def cli(
    ctx: click.Context,
    api: str | None,
    token: str | None,
    user: str | None,
    data_dir: Path | None,
    tls_ca: Path | None,
    plaintext: bool | None,
    as_json: bool | None,
) -> None:
    """Rhizome: train on cheap preemptible GPUs without babysitting them."""
    ctx.obj = Ctx(
        api, user, (data_dir or DEFAULT_DATA_DIR).expanduser(), token, tls_ca, bool(plaintext)
    )
    ctx.obj.json = bool(as_json)
    # Commands of other parts (estimate, inject, image) read their own --json and
    # --data-dir; the group's reach them as defaults.
    ctx.default_map = defaults_for(cli, {"as_json": True} if as_json else {}, data_dir)


# -- platform -------------------------------------------------------------------------------
@cli.command()
@click.option(
    "--embedded",
    is_flag=True,
    help="Start real etcd, MongoDB-wire and Elasticsearch-API servers too.",
)
@click.option(
    "--etcd", envvar="RHIZOME_ETCD", default="", help="Use this etcd instead of an embedded one."
)
@click.option(
    "--mongodb-uri", envvar="RHIZOME_MONGODB_URI", default="", help="Use this MongoDB instead."
)
@click.option(
    "--elasticsearch-url",
    envvar="RHIZOME_ELASTICSEARCH_URL",
    default="",
    help="Use this Elasticsearch instead.",
)
@click.option(
    "--grpc-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="API gRPC port, used exactly or `up` says who holds it (0: any free port; "
    "default: the last run's, else 50051, else any free port).",
)
@click.option(
    "--rest-port",
    type=click.IntRange(0, 65535),
    default=None,
    help="REST gateway port, as --grpc-port (default: the last run's, else 8080).",
)
@click.option("--services", default="", help="Services the daemon hosts (default: all).")
@click.option(
    "--backend",
    type=click.Choice(["local", "docker"]),
    default="local",
    show_default=True,
    help="Where learners run: processes here, or containers (DOCKER_HOST's engine, else a "
    "dockerd started under the data directory).",
)
@click.option(
    "--tls-cert",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Serve the API over TLS with this PEM certificate (chain) instead of the platform's "
    "own (generated in <data dir>/tls); needs --tls-key.",
)
@click.option(
    "--tls-key",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The unencrypted PEM private key of --tls-cert.",
)
@click.option(
    "--tls-ca",
    "up_tls_ca",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The CA that signed --tls-cert, which this CLI and the SDK then trust for this "
    "platform (default: the system's CAs).",
)
@click.option(
    "--insecure-plaintext",
    "plaintext",
    is_flag=True,
    help="Serve the API without TLS: tokens travel in clear text (FfDL-era clients).",
)
@click.option(
    "--standby",
    is_flag=True,
    help="Also run a hot standby daemon: it takes over within milliseconds when the active "
    "one dies, and the CLI and SDK fail over to it (docs/high-availability.md).",
)
@guardians_per_host_option(daemon=False)
@click.option("--foreground", is_flag=True, help="Stay in the foreground; Ctrl-C stops everything.")
@click.pass_obj
def up(
    obj: Ctx,
    embedded: bool,
    etcd: str,
    mongodb_uri: str,
    elasticsearch_url: str,
    grpc_port: int | None,
    rest_port: int | None,
    services: str,
    backend: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    up_tls_ca: Path | None,
    plaintext: bool,
    standby: bool,
    guardians_per_host: int | None,
    foreground: bool,
) -> None:
    """Start the platform (with --embedded, its dependencies too). The API serves TLS with
    a certificate generated in the data directory unless told otherwise."""
    from services.embedded import platform
    from services.embedded.process import DependencyError

    if not embedded and not (etcd and mongodb_uri and elasticsearch_url):
        raise click.UsageError(
            "pass --embedded to start etcd, MongoDB and Elasticsearch here, or give all of "
            "--etcd, --mongodb-uri and --elasticsearch-url"
        )
    try:
        state = platform.up(
            obj.data_dir,
            grpc_port,
            rest_port,
            etcd,
            mongodb_uri,
            elasticsearch_url,
            services,
            progress=lambda m: err.print(f"[dim]•[/dim] {m}"),
            backend=backend,
            tls=tls_choice(tls_cert, tls_key, up_tls_ca, plaintext),
            standby=standby,
            daemon_args=[f"--guardians-per-host={guardians_per_host}"]
            if guardians_per_host is not None
            else [],
        )
    except DependencyError as exc:
        err.print(f"[red]error:[/red] {exc}")
        sys.exit(1)
    print_up_summary(err, state, backend)
    if foreground:
        err.print("Press Ctrl-C to stop.")
        try:
            while all(platform.running(state).values()):
                time.sleep(1)
            err.print("[red]a platform process exited; stopping the rest[/red]")
        except KeyboardInterrupt:
            pass
        platform.down(obj.data_dir, progress=lambda m: err.print(f"[dim]•[/dim] {m}"))


def tls_choice(cert: Path | None, key: Path | None, ca: Path | None, plaintext: bool) -> Any:
    """`up`'s TLS flags as the embedded platform's TlsChoice; contradictions are usage errors."""
    from services.embedded.platform import TlsChoice

    if plaintext and (cert or key or ca):
        raise click.UsageError("--insecure-plaintext and --tls-cert/--tls-key/--tls-ca contradict")
    if bool(cert) != bool(key):
        raise click.UsageError("--tls-cert and --tls-key go together: pass both, or neither")
    if ca and not cert:
        raise click.UsageError("--tls-ca names the CA of your --tls-cert; pass that too")
    return TlsChoice(plaintext, str(cert or ""), str(key or ""), str(ca or ""))


@cli.command()
@click.pass_obj
def down(obj: Ctx) -> None:
    """Stop the embedded platform (data is kept)."""
    from services.embedded import platform

    if not platform.down(obj.data_dir, progress=lambda m: err.print(f"[dim]•[/dim] {m}")):
        err.print(f"nothing to stop: no platform state in {obj.data_dir}")
        return
    err.print("[green]stopped[/green]")


@cli.command()
@json_option
@click.pass_obj
def status(obj: Ctx, as_json: bool) -> None:
    """Show whether the embedded platform runs, with pids, addresses and logs."""
    from services.embedded import platform

    info = platform.status(obj.data_dir)
    if as_json:
        emit_json(info)
        sys.exit(0 if info["running"] else 1)
    if not info["components"]:
        out.print(
            f"not running (data dir {info['data_dir']}); start it with `rhizome up --embedded`"
        )
        sys.exit(1)
    table = Table("component", "pid", "state", "address", "log")
    for name, comp in info["components"].items():
        state = "[green]up[/green]" if comp["alive"] else "[red]down[/red]"
        table.add_row(name, str(comp["pid"]), state, comp["url"], comp["log"])
    out.print(table)
    urls = info.get("urls", {})
    extra = [f"{k} {urls[k]}" for k in ("rest", "metrics") if urls.get(k)]
    if extra:
        out.print("also: " + ", ".join(extra))
    if not info["running"]:
        sys.exit(1)


# -- jobs ------------------------------------------------------------------------------------
@cli.command()
@click.argument("manifest", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument(
    "code_dir", required=False, type=click.Path(exists=True, file_okay=False, path_type=Path)
)
@click.option(
    "--idempotency-key", default=None, help="Retrying with the same key returns the same job."
)
@click.option("--wait", is_flag=True, help="Wait until the job ends, showing its status changes.")
@json_option
@click.pass_obj
@handles_errors
def train(
    obj: Ctx,
    manifest: Path,
    code_dir: Path | None,
    idempotency_key: str | None,
    wait: bool,
    as_json: bool,
) -> None:
    """Submit MANIFEST (with the training code in CODE_DIR, default: the manifest's folder)."""
    raw = manifest.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ClientError(
            "INVALID_ARGUMENT",
            f"{manifest}: not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}); "
            "save the manifest as UTF-8",
        ) from None
    try:
        parse_manifest(raw)  # a bad manifest fails here, before anything is packaged
    except ManifestError as exc:
        raise ClientError("INVALID_ARGUMENT", f"{manifest}: {exc}") from None
    code = code_dir or manifest.parent
    if not as_json:
        err.print(f"packaging {code} ...")
    archive = zip_directory(code)
    if not as_json:
        err.print(f"uploading {len(archive) / 2**20:.1f} MiB of code ({len(archive):,} bytes)")
    if as_json or len(archive) <= UPLOAD_CHUNK:
        resp = obj.client.create_job(text, archive, idempotency_key)
    else:
        from services.client.upload_progress import upload_progress

        with upload_progress(err, len(archive)) as report:
            resp = obj.client.create_job(text, archive, idempotency_key, progress=report)
    if as_json:
        emit_json(to_dict(resp))
    else:
        note = " (an earlier submit with this key)" if resp.existing else ""
        out.print(f"job [bold]{resp.job_id}[/bold] {status_name(resp.job.status)}{note}")
    if wait:
        sys.exit(_wait(obj.client, resp.job_id, quiet=as_json))


PROGRESS_EVERY_S = 2.0  # how often `train --wait` reads the job's metrics


def _wait(client: Client, job_id: str, quiet: bool = False, timeout_s: float = 0) -> int:
    """Wait for the job to end, printing its status changes and, while it trains, its
    step, loss and ETA from its metrics (services/client/progress.py)."""
    from services.client.progress import progress_of

    last = ""
    shown = ""
    start = time.monotonic()
    next_progress = start
    while True:
        job = client.get_job(job_id)
        name = status_name(job.status)
        if name != last and not quiet:
            err.print(f"  {time.strftime('%H:%M:%S')} {name} {job.status_message}")
        last = name
        if name in TERMINAL:
            return 0 if name == "COMPLETED" else 1
        if not quiet and name == "PROCESSING" and time.monotonic() >= next_progress:
            next_progress = time.monotonic() + PROGRESS_EVERY_S
            try:
                now = progress_of(client.metrics(tds_pb2.MetricsRequest(job_id=job_id, learner=-1)))
            except ClientError:
                now = None  # no metrics service reachable: the status lines still come
            if now is not None and now.line() != shown:
                shown = now.line()
                err.print(f"  {time.strftime('%H:%M:%S')} {shown}")
        if timeout_s and time.monotonic() - start > timeout_s:
            return 2
        time.sleep(0.5)


@cli.command(name="list")
@click.option("--status", "statuses", multiple=True, help="Only jobs in this status (repeatable).")
@click.option("--name", "name_prefix", default="", help="Only jobs whose name starts with this.")
@click.option(
    "--limit", type=int, default=50, show_default=True, help="At most this many jobs (0: all)."
)
@json_option
@click.pass_obj
@handles_errors
def list_(obj: Ctx, statuses: tuple[str, ...], name_prefix: str, limit: int, as_json: bool) -> None:
    """List your jobs, newest first."""
    jobs = []
    for job in obj.client.iter_jobs(list(statuses), name_prefix):
        jobs.append(job)
        if limit and len(jobs) >= limit:
            break
    if as_json:
        emit_json([to_dict(j) for j in jobs])
        return
    if not jobs:
        out.print("no jobs")
        return
    table = Table()
    # Ids are shown whole, folded if the terminal is narrow: a cut id cannot be pasted.
    table.add_column("id", overflow="fold", min_width=max(len(j.job_id) for j in jobs))
    for header in ("name", "status", "learners", "created", "since"):
        table.add_column(header)
    for job in jobs:
        since = job.history[-1].time if job.history else job.created_at
        table.add_row(
            job.job_id,
            job.name,
            status_name(job.status),
            str(job.resources.learners),
            fmt_time(job.created_at),
            fmt_time(since),
        )
    out.print(table)


@cli.command()
@job_id_argument
@json_option
@click.pass_obj
@handles_errors
def show(obj: Ctx, job_id: str, as_json: bool) -> None:
    """Show one job: status, why it waits, its history, and a failed job's last lines."""
    job = obj.client.get_job(job_id)
    if as_json:
        doc = {**to_dict(job), **job_cost(obj.client, job)}
        stages = stage_rows(obj.client, job) if job.placement.learner_nodes else []
        emit_json({**doc, "stages": stages} if stages else doc)
        return
    res = job.resources
    out.print(f"[bold]{job.job_id}[/bold]  {job.name}  owner={job.owner}")
    out.print(f"status: [bold]{status_name(job.status)}[/bold] {job.status_message}")
    gpu = f" × {res.gpus:g} {res.gpu_type or 'GPU'}" if res.gpus else ""
    out.print(
        f"resources: {res.learners} learner(s){gpu}, {res.cpus:g} CPU, {res.memory_mb:g} MB each"
    )
    if job.queue_reason:
        out.print(f"waiting because: {job.queue_reason}")
    if job.placement.learner_nodes:
        nodes = ", ".join(f"{r}→{n}" for r, n in sorted(job.placement.learner_nodes.items()))
        out.print(f"placement: {nodes}")
        stages = stage_rows(obj.client, job)
        if stages:
            print_stage_table(out, stages)
    if job.last_metrics:
        shown = ", ".join(f"{m.name}={m.value:.4g} (step {m.step})" for m in job.last_metrics)
        out.print(f"last metrics: {shown}", markup=False)
    _print_cost(job_cost(obj.client, job))
    if job.checkpoints:
        saves = Table("time", "kind", "step", "size", "learner", title="checkpoints")
        for c in job.checkpoints:
            saves.add_row(
                fmt_time(c.time),
                c.kind,
                str(c.step),
                fmt_bytes(c.size_bytes),
                c.learner,
            )
        out.print(saves)
    table = Table("time", "status", "message", title="history")
    for h in job.history:
        table.add_row(fmt_time(h.time), status_name(h.status), h.message)
    out.print(table)
    if status_name(job.status) == "FAILED":
        _print_last_lines(obj.client, job)


def _dollars(d: float) -> str:
    """Cents, and tenths of a cent under a dollar: a short job's cost is not `$0.00`."""
    return f"${d:.4f}" if d < 1 else f"${d:.2f}"


def _print_cost(found: dict[str, Any]) -> None:
    cost, left = found["cost_so_far"], found["estimate_to_finish"]
    if cost is None:
        out.print("cost so far: unknown (the scheduler did not answer)")
    else:
        unpriced = f"; not priced: {', '.join(cost['unpriced'])}" if cost["unpriced"] else ""
        out.print(
            f"cost so far: {_dollars(cost['dollars'])} "
            f"({cost['node_hours']:.2f} node-hours{unpriced})",
            markup=False,
        )
    if left is not None:
        if left["problem"]:
            out.print(f"to finish: {left['problem']}", markup=False)
        elif left["steps_done"] >= left["steps_total"]:
            done = f"{left['steps_done']} of {left['steps_total']}"
            out.print(f"to finish: no steps left ({done} done)")
        else:
            out.print(
                f"to finish: {_dollars(left['dollars'])}, {left['hours'] * 60:.1f} min for steps "
                f"{left['steps_done']}-{left['steps_total']} ({left['strategy']} checkpointing, "
                f"preemptions as in {left['model']})",
                markup=False,
            )


def _print_last_lines(client: Client, job: job_pb2.Job, count: int = 20) -> None:
    """A failed job's last lines: from the log store, which outlives the learners, else
    the tail the guardian kept on the record."""
    lines: list[str] = []
    try:
        req = tds_pb2.LogsRequest(job_id=job.job_id, learner=-1, pos=-count)
        lines = [f"[{ln.learner}/{ln.stream}] {ln.line}" for ln in client.logs(req)]
    except ClientError:
        pass  # no log service reachable: the record's copy below
    lines = lines or list(job.last_log_lines)
    if lines:
        out.print(f"last log lines (exit code {job.exit_code}):")
        for line in lines:
            out.print(f"  {line}", markup=False)


def _job_action(name: str, method: str, help_text: str, done: Callable[[str], bool]) -> None:
    """A command that asks for a status change and, unless --no-wait, waits until the job
    got there (`done(status)`), so that what it prints is the state the action produced:
    a halt or delete of a running job takes effect when its guardian has stopped the
    learners, not when the API answers."""

    @cli.command(name=name, help=help_text)
    @job_id_argument
    @click.option("--no-wait", is_flag=True, help="Print the state right after the request.")
    @click.option(
        "--timeout", type=float, default=120.0, show_default=True, help="Seconds to wait."
    )
    @json_option
    @click.pass_obj
    @handles_errors
    def command(obj: Ctx, job_id: str, no_wait: bool, timeout: float, as_json: bool) -> None:
        job = getattr(obj.client, method)(job_id)
        deadline = time.monotonic() + timeout
        shown = status_name(job.status)
        while not no_wait and not done(status_name(job.status)):
            if time.monotonic() > deadline:
                err.print(
                    f"job {job.job_id} is still {status_name(job.status)} after {timeout:.0f} s; "
                    f"the {name} request stands: follow it with `rhizome show {job.job_id}`"
                )
                sys.exit(2)
            if not as_json and status_name(job.status) != shown:
                shown = status_name(job.status)
                err.print(f"  {time.strftime('%H:%M:%S')} {shown}")
            time.sleep(0.3)
            job = obj.client.get_job(job.job_id)
        if as_json:
            emit_json(to_dict(job))
        else:
            out.print(f"job {job.job_id} {status_name(job.status)}")


_job_action(
    "halt",
    "halt_job",
    "Halt a job: its learners save and stop; resume it later.",
    lambda status: status in TERMINAL,  # HALTED, or an end it reached first
)
_job_action(
    "resume",
    "resume_job",
    "Resume a halted job from its checkpoint (it is queued and placed again).",
    lambda status: status != "HALTED",
)
_job_action(
    "delete",
    "delete_job",
    "Delete a job: stop it and forget it.",
    lambda status: status == "DELETED",
)


@cli.command()
@job_id_argument
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@click.option("--learner", type=int, default=-1, help="Only this learner's lines.")
@click.option("--search", default="", help="Only lines matching this full-text query.")
@click.option(
    "--since", type=float, default=0.0, help="Only lines newer than this many seconds ago."
)
@click.option("--tail", "pos", type=int, default=0, help="Only the last N lines.")
@json_option
@click.pass_obj
@handles_errors
def logs(
    obj: Ctx,
    job_id: str,
    follow: bool,
    learner: int,
    search: str,
    since: float,
    pos: int,
    as_json: bool,
) -> None:
    """Print a job's log lines, prefixed by learner."""
    req = tds_pb2.LogsRequest(
        job_id=job_id, follow=follow, learner=learner, search=search, pos=-abs(pos) if pos else 0
    )
    if since:
        req.since.FromNanoseconds(int((time.time() - since) * 1e9))
    for line in obj.client.logs(req):
        if as_json:
            click.echo(json.dumps(to_dict(line)))
        else:
            click.echo(f"[{line.learner}/{line.stream}] {line.line}")


@cli.command()
@job_id_argument
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also draw the curves into this PNG file: a panel per metric, a line per learner.",
)
@json_option
@click.pass_obj
@handles_errors
def metrics(obj: Ctx, job_id: str, plot: Path | None, as_json: bool) -> None:
    """Show the latest value of each of a job's metrics."""
    samples = list(obj.client.metrics(tds_pb2.MetricsRequest(job_id=job_id, learner=-1)))
    if as_json:
        emit_json([to_dict(s) for s in samples])
    else:
        latest = sorted(latest_values(samples), key=lambda r: (r.learner, r.name))
        table = Table("learner", "metric", "step", "value")
        for row in latest:
            table.add_row(str(row.learner), row.name, str(row.step), f"{row.value:.6g}")
        out.print(table if latest else "no metrics yet")
    if plot:
        try:
            plot_metrics(samples, plot, title=job_id)
        except ValueError as exc:  # no samples yet, not a .png
            err.print(f"[red]error:[/red] {escape(str(exc))}")
            sys.exit(1)
        err.print(f"plot written to {plot}")


@cli.command()
@json_option
@click.pass_obj
@handles_errors
def cluster(obj: Ctx, as_json: bool) -> None:
    """Show the cluster: nodes, free resources, queued and running jobs."""
    view = obj.client.cluster()
    if as_json:
        emit_json(to_dict(view))
        return
    table = Table(
        "node", "zone", "gpu type", "gpus free/total", "cpus free/total", "memory MB free/total"
    )
    for n in view.nodes:
        table.add_row(
            n.name,
            n.zone,
            n.gpu_type or "-",
            f"{n.gpus_free}/{n.gpus_total}",
            f"{n.cpus_free:g}/{n.cpus_total:g}",
            f"{n.memory_mb_free:g}/{n.memory_mb_total:g}",
        )
    if view.nodes:
        out.print(table)
    out.print(f"queued jobs: {view.queued_jobs}, running jobs: {view.running_jobs}")


# -- tokens ----------------------------------------------------------------------------------
@cli.command()
@json_option
@click.pass_obj
@handles_errors
def version(obj: Ctx, as_json: bool) -> None:
    """Show the client's and the server's versions."""
    from services import __version__

    info = obj.client.version()
    if as_json:
        emit_json({"client": __version__, "server": to_dict(info)})
    else:
        out.print(
            f"client {__version__}, server {info.version} ({info.api}; services: {', '.join(info.services)})"
        )


# Commands whose code lives with the part they drive (the spot simulator, the preemption
# injector, the image builder); plain click commands registered here so `rhizome` is the
# one door.
PLUGGED_COMMANDS = (
    ("services.client.doctor", "doctor"),
    ("services.client.doctor", "completion"),
    ("services.sim.cli", "estimate"),
    ("services.injector.cli", "inject"),
    ("services.images.cli", "image"),
    ("services.client.tokens_cli", "token"),
    ("services.client.ffdl_cli", "download"),
    ("services.client.ffdl_cli", "events"),
    ("services.client.scale_cli", "scale"),
)


# Plugged commands that get the global options after their name: those that call the API
# (the others read their own --data-dir and --json; the group's reach them as defaults).
CALLS_THE_API = {"token", "doctor", "download", "events", "scale"}


def _plug_commands() -> None:
    import importlib

    for own in cli.commands.values():
        add_global_options(own)
    for module, name in PLUGGED_COMMANDS:
        command = getattr(importlib.import_module(module), name)
        if name in CALLS_THE_API:
            add_global_options(command)
        cli.add_command(command, name)


def undecodable_argument(argv: list[str]) -> str | None:
    """The first argument that is not UTF-8 (Python keeps its bytes as surrogates, which
    no gRPC call or file name of ours can carry), as a message; None when all are."""
    for i, arg in enumerate(argv, start=1):
        try:
            arg.encode("utf-8")
        except UnicodeEncodeError:
            raw = os.fsencode(arg)
            return (
                f"argument {i} ({raw!r}) is not valid UTF-8; pass text in UTF-8 "
                "(check the terminal's and the shell's locale, e.g. LANG=C.UTF-8)"
            )
    return None


def main() -> None:
    bad = undecodable_argument(sys.argv[1:])
    if bad:
        err.print(f"[red]error:[/red] {escape(bad)}")
        sys.exit(2)
    _plug_commands()
    try:
        cli(prog_name="rhizome")
    except ClientError as exc:  # raised outside a command's own handler (a prefix lookup)
        err.print(f"[red]error:[/red] {exc.message}")
        sys.exit(1)
    except Exception as exc:  # the last line of defence: no traceback to the user
        from services.embedded.process import DependencyError

        if isinstance(exc, DependencyError):  # a stale data dir, a busy port: said whole
            err.print(f"[red]error:[/red] {exc}")
            sys.exit(1)
        if os.environ.get("RHIZOME_DEBUG"):
            raise
        err.print(
            f"[red]error:[/red] {type(exc).__name__}: {exc} (set RHIZOME_DEBUG=1 for details)"
        )
        sys.exit(1)


if __name__ == "__main__":
    main()
