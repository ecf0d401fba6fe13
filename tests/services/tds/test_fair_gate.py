"""The TDS's write gate: at most `slots` writes at once, waiting writers admitted
round-robin by learner, so one learner's backlog does not crowd out another's batch."""

from __future__ import annotations

import threading
import time

import pytest

from services.tds.fair import CallerGone, FairGate, GateBusy


def _wait(cond: object, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.005)
    assert cond(), "condition not reached"  # type: ignore[operator]


def test_a_second_learner_goes_before_the_first_ones_backlog() -> None:
    gate = FairGate(1)
    order: list[str] = []
    lock = threading.Lock()

    def write(key: str, name: str) -> None:
        with gate.slot(key), lock:
            order.append(name)

    holding = threading.Event()
    release = threading.Event()

    def holder() -> None:
        with gate.slot("a"):
            holding.set()
            release.wait(10)

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    holding.wait(10)
    # Learner a queues three batches, then learner b one.
    for i in range(3):
        t = threading.Thread(target=write, args=("a", f"a{i}"))
        t.start()
        threads.append(t)
        _wait(lambda n=i + 1: gate.waiting() == n)
    t = threading.Thread(target=write, args=("b", "b0"))
    t.start()
    threads.append(t)
    _wait(lambda: gate.waiting() == 4)
    release.set()
    for t in threads:
        t.join(10)
    assert order == ["a0", "b0", "a1", "a2"]


def test_no_more_than_the_slots_write_at_once() -> None:
    gate = FairGate(2)
    inside, most = 0, 0
    lock = threading.Lock()

    def write(key: int) -> None:
        nonlocal inside, most
        with gate.slot(key):
            with lock:
                inside += 1
                most = max(most, inside)
            time.sleep(0.01)
            with lock:
                inside -= 1

    threads = [threading.Thread(target=write, args=(k % 3,)) for k in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert most <= 2 and inside == 0


def test_zero_slots_is_refused_saying_why() -> None:
    with pytest.raises(ValueError, match="slots is 0"):
        FairGate(0)


def test_a_writer_whose_caller_gave_up_leaves_the_line_and_the_others_go_on() -> None:
    gate = FairGate(1)
    release, holding = threading.Event(), threading.Event()
    gave_up = threading.Event()
    outcome: dict[str, str] = {}

    def holder() -> None:
        with gate.slot("a"):
            holding.set()
            release.wait(10)

    def write(key: str, name: str, gone: object = None) -> None:
        try:
            with gate.slot(key, gone=gone):  # type: ignore[arg-type]
                outcome[name] = "written"
        except CallerGone:
            outcome[name] = "left"

    first = threading.Thread(target=holder)
    first.start()
    holding.wait(10)
    quitter = threading.Thread(target=write, args=("b", "b0", gave_up.is_set))
    quitter.start()
    _wait(lambda: gate.waiting() == 1)
    patient = threading.Thread(target=write, args=("c", "c0"))
    patient.start()
    _wait(lambda: gate.waiting() == 2)
    gave_up.set()  # b's caller goes away while a holds the only slot
    quitter.join(10)
    assert outcome == {"b0": "left"} and gate.waiting() == 1
    release.set()
    first.join(10)
    patient.join(10)
    assert outcome == {"b0": "left", "c0": "written"} and gate.waiting() == 0


def test_a_writer_admitted_after_its_caller_gave_up_does_not_write() -> None:
    gate = FairGate(1)
    with pytest.raises(CallerGone), gate.slot("a", gone=lambda: True):
        raise AssertionError("the write ran for a caller that had gone")
    with gate.slot("a"):  # the slot is free again
        pass


def test_a_writer_not_admitted_within_its_longest_wait_leaves_the_line_busy() -> None:
    gate = FairGate(1)
    with gate.slot("a"):  # the only slot, held
        with pytest.raises(GateBusy), gate.slot("b", max_wait_s=0.05):
            raise AssertionError("admitted while the only slot was held")
        assert gate.waiting() == 0
    with gate.slot("b", max_wait_s=0.05):  # free again: admitted at once
        pass
