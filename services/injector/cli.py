"""`rhizome inject` / `python -m services.injector`: preempt a running job's learners
(`--job`, found through etcd) or given processes (`--pid`)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import click

from contract.credentials import redact_uri
from contract.etcd import EtcdClient, EtcdCredentials, StoreUnavailable
from services.config import DEFAULT_DATA_DIR
from services.embedded.platform import load_state
from services.injector.injector import Injector, exponential_schedule, trace_schedule
from services.injector.targets import InjectorError, JobTargets, PidTargets, Targets
from services.security.etcd_auth import platform_credentials
from services.sim.traces import TraceError


@click.command(name="inject")
@click.option(
    "--pid",
    "pids",
    type=int,
    multiple=True,
    help="A learner process id to target; repeat for each learner (or give --job).",
)
@click.option(
    "--job",
    "job_id",
    type=str,
    default=None,
    help="Instead of --pid: preempt this running job's current learners (a learner the "
    "guardian restarts under a new pid is a target again). With --trace, a removal is the "
    "job's with probability learners / nodes alive, as in the spot simulator.",
)
@click.option(
    "--etcd",
    "etcd_url",
    envvar="RHIZOME_ETCD",
    default="",
    help="With --job: the platform's etcd client URL (the daemon's --etcd; env RHIZOME_ETCD; "
    "default: the embedded platform's in --data-dir).",
)
@click.option(
    "--data-dir",
    type=click.Path(path_type=Path, file_okay=False),
    envvar="RHIZOME_DATA_DIR",
    default=str(DEFAULT_DATA_DIR),
    show_default=True,
    help="With --job and no --etcd: the embedded platform whose etcd to use.",
)
@click.option(
    "--trace",
    type=str,
    default=None,
    help="Trace to replay (a path, or a bundled trace name such as "
    "aws-p3-64.csv); each 'remove' preempts one target.",
)
@click.option(
    "--mttp",
    type=float,
    default=None,
    help="Instead of a trace: exponential inter-arrivals with this mean time to "
    "preemption, in seconds.",
)
@click.option(
    "--count",
    type=int,
    default=1,
    show_default=True,
    help="With --mttp: how many preemptions to draw.",
)
@click.option(
    "--notice",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds between SIGTERM and SIGKILL (the grace period the learners get).",
)
@click.option(
    "--time-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Divide trace times by this (1000 replays a day in under 90 s).",
)
@click.option(
    "--start",
    type=float,
    default=0.0,
    show_default=True,
    help="Trace time (seconds) to start the replay from.",
)
@click.option(
    "--delay",
    type=float,
    default=0.0,
    show_default=True,
    help="Seconds added before every scheduled preemption (lets the job start).",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for draws and targets.")
@click.option(
    "--log",
    "log_path",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="Append one JSON line per preemption here.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the injections as JSON.")
def inject(
    pids: tuple[int, ...],
    job_id: str | None,
    etcd_url: str,
    data_dir: Path,
    trace: str | None,
    mttp: float | None,
    count: int,
    notice: float,
    time_scale: float,
    start: float,
    delay: float,
    seed: int,
    log_path: Path | None,
    as_json: bool,
) -> None:
    """Preempt learner processes: SIGTERM, then SIGKILL when the notice runs out.

    Give exactly one of --pid or --job, and one of --trace or --mttp.
    """
    if (trace is None) == (mttp is None):
        raise click.UsageError("give exactly one of --trace FILE or --mttp SECONDS")
    if bool(pids) == (job_id is not None):
        raise click.UsageError("give --pid PID (repeatable) or --job JOB_ID, not both or neither")
    credentials: EtcdCredentials | None = None  # else $RHIZOME_ETCD_CREDENTIALS_FILE's
    if job_id is not None and not etcd_url:
        state = load_state(data_dir)
        etcd_url = state.urls.get("etcd", "") if state is not None else ""
        if not etcd_url:
            raise click.UsageError(
                f"--job needs the platform's etcd: no embedded platform in {data_dir} "
                "(`rhizome up`), so pass --etcd URL or set RHIZOME_ETCD"
            )
        try:  # the embedded etcd requires its platform user
            credentials = platform_credentials(data_dir)
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"the platform's etcd credentials: {exc}") from exc
    etcd: EtcdClient | None = None
    try:
        targets: Targets
        nodes: int | None = None
        if job_id is not None:
            etcd = EtcdClient.connect(etcd_url, credentials=credentials)
            job = JobTargets(etcd, job_id)
            job.check()
            targets, nodes = job, job.learners()
        else:
            targets = PidTargets(list(pids))
        if trace is not None:
            schedule = trace_schedule(
                trace, time_scale=time_scale, start_s=start, job_nodes=nodes, seed=seed
            )
        else:
            assert mttp is not None
            schedule = exponential_schedule(mttp, count, seed=seed)
        schedule = [t + delay for t in schedule]
        injector = Injector(targets, schedule, notice_s=notice, seed=seed, log_path=log_path)
        if not as_json:
            click.echo(
                f"{len(schedule)} preemption(s) scheduled over {max(schedule, default=0):.1f} s",
                err=True,
            )
        done = injector.run()
    except (InjectorError, TraceError) as err:
        raise click.BadParameter(str(err)) from err
    except StoreUnavailable as err:
        raise click.ClickException(f"etcd at {redact_uri(etcd_url)} is unreachable: {err}") from err
    finally:
        if etcd is not None:
            etcd.close()
    if as_json:
        click.echo(json.dumps([asdict(i) for i in done], indent=2))
    else:
        for i in done:
            left = f"{i.left_after_s:.2f}s" if i.left_after_s is not None else "-"
            who = f"rank={i.rank}" if i.rank is not None else f"pid={i.pid}"
            click.echo(
                f"t={i.at_s:9.2f}s {who} {'+'.join(i.events) or '-'} -> {i.outcome} ({left})"
            )


def main() -> None:
    inject(prog_name="python -m services.injector")


if __name__ == "__main__":
    main()
