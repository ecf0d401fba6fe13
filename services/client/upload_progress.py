"""What `rhizome train` shows while code uploads: a live bar on a terminal, else a line
at each quarter (logs and CI output stay readable). rich draws the bar."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

Report = Callable[[int, int], None]  # (bytes sent, bytes in all)


@contextmanager
def upload_progress(console: Console, total: int) -> Iterator[Report]:
    if console.is_terminal:
        with Progress(
            TextColumn("uploading"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
            transient=True,
        ) as bar:
            task = bar.add_task("upload", total=total)
            yield lambda sent, _: bar.update(task, completed=sent)
        return
    marks = [total * quarter // 4 for quarter in (1, 2, 3, 4)]
    passed = 0

    def report(sent: int, _: int) -> None:
        nonlocal passed
        crossed = passed
        while crossed < len(marks) and sent >= marks[crossed]:
            crossed += 1
        if crossed > passed:  # one line per call, however many quarters it crossed
            passed = crossed
            console.print(f"uploaded {sent / 2**20:.1f} of {total / 2**20:.1f} MiB")

    yield report
