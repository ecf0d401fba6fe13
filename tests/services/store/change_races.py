"""Writers racing a reader of changes by stamp (the LCM's change rounds, the listing
index), with writes that land late: what such a reader must not miss."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from services.store import states
from services.store.jobs import JobRecord, JobsRepository


def placed_late(repo: JobsRepository, job: JobRecord, stamp: float) -> None:
    """Move QUEUED `job` to PENDING stamped `stamp` (a time past): as from a writer whose
    clock is behind, or a write that lands that long after its stamp."""
    repo._col.update_one(
        {"_id": job.job_id, "version": job.version},
        {
            "$set": {
                "status": states.PENDING,
                "version": job.version + 1,
                "updated_at": stamp,
                "touched_at": stamp,
            }
        },
    )


def write_while_reading(
    read: Callable[[], object], writers: list[Callable[[], object]], settle_s: float
) -> None:
    """Run `read` over and over while every one of `writers` runs at once, and for
    `settle_s` after the last has returned (by then every write has landed and is older
    than the reader's look-back)."""
    stop = threading.Event()

    def reading() -> None:
        while not stop.is_set():
            read()
            time.sleep(0.05)

    reader = threading.Thread(target=reading)
    reader.start()
    try:
        threads = [threading.Thread(target=w) for w in writers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(settle_s)
    finally:
        stop.set()
        reader.join()
