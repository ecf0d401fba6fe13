"""Job ids sort in creation order, even when many are made in one millisecond."""

from __future__ import annotations

import threading

from services.store.jobs import _JobIdClock, new_job_id


def test_ids_made_in_the_same_millisecond_sort_in_creation_order() -> None:
    clock = _JobIdClock()
    ids = [clock.next(now=1_700_000_000.0005) for _ in range(1000)]
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids)


def test_ids_keep_increasing_when_the_wall_clock_steps_back() -> None:
    clock = _JobIdClock()
    first = clock.next(now=1_700_000_010.0)
    later = clock.next(now=1_700_000_000.0)
    assert later > first


def test_more_ids_than_the_sequence_holds_borrow_the_next_millisecond() -> None:
    clock = _JobIdClock()
    ids = [clock.next(now=1_700_000_000.0) for _ in range(0x10000 + 5)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


def test_concurrent_callers_never_get_the_same_id() -> None:
    got: list[str] = []
    lock = threading.Lock()

    def make() -> None:
        mine = [new_job_id() for _ in range(500)]
        with lock:
            got.extend(mine)

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 2000


def test_ids_from_two_processes_in_one_millisecond_order_the_same_way_on_every_read() -> None:
    a, b = _JobIdClock(), _JobIdClock()
    ids = [a.next(now=1_700_000_000.0), b.next(now=1_700_000_000.0)]
    assert ids[0][:20] == ids[1][:20]  # the same time and sequence: only the suffix differs
    assert ids[0] != ids[1]
    # The order is the suffixes' order, a property of the ids alone, not of when they were read.
    assert (ids[0] < ids[1]) == (a._suffix < b._suffix)
