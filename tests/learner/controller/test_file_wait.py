"""FileWait (learner/controller/file_wait.py): the collector's inotify wake-ups."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from learner.controller.file_wait import FileWait

# Long enough that a wake-up that did not come fails the test by its timeout alone.
NEVER_S = 30.0


@pytest.fixture
def waiter(tmp_path: Path) -> Iterator[FileWait]:
    w = FileWait.open([tmp_path / "stdout.log", tmp_path / "stderr.log"])
    if w is None:
        pytest.skip("no inotify here")
    yield w
    w.close()


def test_a_write_to_a_watched_file_wakes_the_wait(tmp_path: Path, waiter: FileWait) -> None:
    (tmp_path / "stdout.log").write_text("")  # created after the watch began: still seen
    waiter.clear()
    timer = threading.Timer(0.2, lambda: (tmp_path / "stdout.log").write_text("a line\n"))
    timer.start()
    assert waiter.wait(NEVER_S) is True
    timer.join()


def test_a_write_before_the_wait_is_not_missed(tmp_path: Path, waiter: FileWait) -> None:
    with open(tmp_path / "stderr.log", "a") as f:
        f.write("written between the read and the wait\n")
    assert waiter.wait(NEVER_S) is True


def test_other_files_of_the_directory_do_not_wake_it(tmp_path: Path, waiter: FileWait) -> None:
    (tmp_path / "collector.offsets.json").write_text("{}")
    assert waiter.wait(0.3) is False
    assert not waiter.broken


def test_clear_forgets_what_was_read(tmp_path: Path, waiter: FileWait) -> None:
    (tmp_path / "stdout.log").write_text("read already\n")
    waiter.clear()
    assert waiter.wait(0.3) is False


def test_interrupt_wakes_it_from_another_thread(waiter: FileWait) -> None:
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(waiter.wait(NEVER_S)))
    thread.start()
    waiter.interrupt()
    thread.join(NEVER_S / 3)  # not woken: still waiting here
    assert got == [False]
    waiter.close()
    waiter.interrupt()  # after close: a no-op, not a write to a reused descriptor
