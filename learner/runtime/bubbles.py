"""Where eager FRC fits: the pipeline bubble, predicted from the previous step's waits.

A stage's schedule repeats every step, and so do its waits: the receive that waited
40 ms for the successor's first gradient last step will wait about as long this step.
The schedule's FRC plan (``schedule.frc_plan``) names the waits that are bubbles by
construction of the order (warm-up, cool-down, pipeline fill) and how many FRC forwards
each holds. ``BubblePredictor`` remembers how long each receive (named by its place in
the block's instruction list) took from post to arrival, and the cost of one FRC
forward; the interpreter runs a pending FRC while a receive is in flight only if it is
predicted to end before the message arrives; the last stage takes its pipeline-fill
wait as at least its planned FRC forwards long (a stage that arrived late last step
measured its bubble short). What does not fit anywhere runs in the sync phase, while the worker waits for
its replica's update (free on the last stage, whose cool-down bubble is at the end of
the step). The first step has no FRC cost measured and fills nothing.

Measured waits do not depend on the filler: the receive runs in its own thread and its
arrival time is taken there, so the prediction does not shrink as the bubble fills.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Hashable


class BubblePredictor:
    """Per-receive wait history and FRC cost, for one worker.

    Medians, not the last value: on a shared machine one slow step would otherwise
    make the next step fill a bubble that is not there (or skip one that is).
    """

    def __init__(self, overrun: float = 0.1, wait_window: int = 3, cost_window: int = 5) -> None:
        """``overrun``: how far (a fraction of one FRC) a fill may end after the message.

        Worth more than zero where a leftover FRC would sit on the critical path anyway
        (every stage but the last, whose sync phase waits for its replica's update).
        """
        self._waits: dict[Hashable, deque[float]] = {}
        self._costs: deque[float] = deque(maxlen=cost_window)
        self._wait_window = wait_window
        self._overrun = overrun

    @property
    def frc_cost(self) -> float | None:
        return statistics.median(self._costs) if self._costs else None

    def predicted_wait(self, key: Hashable) -> float:
        seen = self._waits.get(key)
        return statistics.median(seen) if seen else 0.0

    def record_wait(self, key: Hashable, seconds: float) -> None:
        self._waits.setdefault(key, deque(maxlen=self._wait_window)).append(seconds)

    def record_frc(self, seconds: float) -> None:
        self._costs.append(seconds)

    def fits(self, key: Hashable, elapsed: float, floor_frcs: int = 0) -> bool:
        """Whether one more FRC, started ``elapsed`` s into this wait, ends before the message.

        ``floor_frcs``: a wait known to be at least that many FRC forwards long whatever
        was measured — the pipeline-fill bubble of stage ``s`` is ``s`` forwards of its
        predecessors by construction of the schedule, but a stage that arrived late last
        step (its own leftover FRC ran long) measured it short, and would then never fill
        it again.
        """
        cost = self.frc_cost
        if cost is None:
            return False
        return elapsed + (1 - self._overrun) * cost <= self._expected(key, cost, floor_frcs)

    def _expected(self, key: Hashable, cost: float, floor_frcs: int) -> float:
        return max(self.predicted_wait(key), floor_frcs * cost)


# where an eager FRC ran: while a message was awaited (a bubble: the pipeline's waits, or
# the sync phase's wait for the replica's update), in the sync phase with nothing awaited
# (on the critical path), past the arrival of the message whose wait it filled (an
# overrun, on the critical path too), or on demand before an eager BRC that needed its graph
IN_BUBBLE, IN_SYNC, OVERRUN, FOR_BRC = "bubble", "sync", "overrun", "brc"
PLACES = (IN_BUBBLE, IN_SYNC, OVERRUN, FOR_BRC)


class FrcProfile:
    """Seconds of eager FRC per step and per place it ran (``PLACES``).

    The claim "the redundant forward runs in the bubbles" is this record: the share of FRC
    time that ran while a message was awaited, against what landed on the critical path
    (the sync phase with nothing awaited, or past a message's arrival).
    """

    def __init__(self) -> None:
        self.per_step: dict[int, dict[str, float]] = {}

    def record(self, step: int, where: str, seconds: float) -> None:
        row = self.per_step.setdefault(step, dict.fromkeys(PLACES, 0.0))
        row[where] += seconds

    def totals(self, first_step: int = 0) -> dict[str, float]:
        """Seconds per place over the steps from ``first_step`` on."""
        out = dict.fromkeys(PLACES, 0.0)
        for step, row in self.per_step.items():
            if step >= first_step:
                for where, seconds in row.items():
                    out[where] += seconds
        return out

    def summary(self, first_step: int = 0) -> str | None:
        """One line for the worker's log at the end of a run (``engine``): mean ms of FRC
        per step in each place and the share in bubbles; None when no FRC ran."""
        steps = [s for s in self.per_step if s >= first_step]
        t = self.totals(first_step)
        total = sum(t.values())
        if not steps or total == 0:
            return None
        per = 1000.0 / len(steps)
        return (
            f"eager FRC per step (steps {min(steps)}-{max(steps)}): "
            f"{t[IN_BUBBLE] * per:.1f} ms in bubbles, {t[IN_SYNC] * per:.1f} ms in the sync "
            f"phase, {t[OVERRUN] * per:.1f} ms past a message's arrival, "
            f"{t[FOR_BRC] * per:.1f} ms before an eager BRC "
            f"({100 * t[IN_BUBBLE] / total:.0f} % in bubbles)"
        )

    def bubble_share(self, first_step: int = 0) -> float | None:
        """Fraction of FRC time that ran inside bubbles; None when no FRC ran."""
        t = self.totals(first_step)
        total = sum(t.values())
        return None if total == 0 else t[IN_BUBBLE] / total
