"""The job queue keeps its order incrementally; it must always equal a full sort."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.api import JobRequest
from services.scheduler.queue import JobQueue

# An operation: push job i (with some shape) or remove job i.
ops = st.lists(
    st.tuples(
        st.sampled_from(["push", "remove"]),
        st.integers(0, 15),  # job number
        st.integers(0, 2),  # priority
        st.integers(0, 4),  # gpus
        st.sampled_from(["", "v100", "k80"]),
        st.floats(0, 10),  # arrival
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_order_and_places_equal_a_full_sort_after_any_pushes_and_removes(
    steps: list[tuple[str, int, int, int, str, float]],
) -> None:
    queue = JobQueue(batch_window_s=1.0)
    for op, n, priority, gpus, gpu_type, arrival in steps:
        job_id = f"job-{n}"
        if op == "push":
            queue.push(
                JobRequest(
                    job_id,
                    learners=1 + n % 3,
                    gpus=gpus,
                    gpu_type=gpu_type if gpus else "",
                    priority=priority,
                    arrival=arrival,
                )
            )
        else:
            queue.remove(job_id)
        entries = [queue.get(j) for j in (f"job-{i}" for i in range(16)) if j in queue]
        expected = sorted(entries, key=lambda e: e.sort_key())  # type: ignore[union-attr]
        assert queue.ordered() == expected
        assert len(queue) == len(expected)
        for entry in expected:
            assert entry is not None
            same_pool = [e for e in expected if e is not None and e.job.pool == entry.job.pool]
            assert queue.ahead_of(entry.job.job_id) == same_pool.index(entry)
