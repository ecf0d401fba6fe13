"""Reading what was written since the last read, by a writer's time stamp, each record
about once and none missed (issue #18).

The readers of changes (the LCM's rounds between its full ones, the jobs listing index
the job gauges refresh) ask for the records whose stamp (`updated_at`, `touched_at`: the
writer's wall clock when it wrote) is past their last read. A stamp is taken before its
write lands, and another process's clock may be behind the reader's, so a read "since
the last one" alone misses a write that lands after the read that passed its stamp. The
readers therefore asked, every read, for everything stamped in a whole look-back before
the last read (`lookback_s`: how late after its stamp a write may land and still be seen
without a full read): each record was read once per read for the whole look-back. During
a burst of submits or of placements that was thousands of records five times a second,
each costing the MongoDB-wire server ~30-40 us of CPU.

`StampedReads` splits that read in two:

- a *fast* read, every time: the records stamped after the previous read began, less a
  short `margin_s` (a write that lands within the margin of its stamp is seen by the next
  read, as before);
- a *band* read, every `band_s` or so: the records stamped in the band that has just
  become older than the look-back, `(band_from, now - lookback_s]`. Every write stamped
  in it has landed by now (that is what the look-back promises), so reading each band once
  sees every write the fast reads missed, and the bands follow each other without a gap
  or an overlap.

A record is read by the fast reads from the one under way when it is written to the
first that begins a margin after its stamp (at most 2 + margin / period of them; one or
two when reads are further apart than the margin) and by exactly one band: at most
3 + margin / period times whatever the look-back, instead of look-back / period times. What is seen by when: a write that lands
within the margin is seen by the next read (as before); one that lands later, but within
the look-back, by the first band read after its stamp is `lookback_s` old (before: the
next read after it landed); one later still, by the reader's full read, as before.

The reader's clock stepping back is handled: the next read asks for the whole look-back
before the lowest reading the clock can have had since the step (the last reading less
the step, told apart from the time passed by the monotonic clock), and the bands go back
as far: a write stamped after the step is stamped at most the look-back before the
clock, as every write. A reader that does not read for a while loses nothing: its next
fast read starts where the last one did.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")

# fetch(after, up_to): the records stamped in (after, up_to]; up_to None: no upper bound.
Fetch = Callable[[float, float | None], Iterable[T]]


def stamp_range(after: float, up_to: float | None) -> dict[str, float]:
    """The query of a stamp field for `Fetch`'s (after, up_to]."""
    return {"$gt": after} if up_to is None else {"$gt": after, "$lte": up_to}


class StampedReads:
    """Where the next read of a stamp field starts: one per reader, not shared."""

    def __init__(
        self,
        lookback_s: float,
        margin_s: float,
        band_s: float,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= margin_s < lookback_s:
            raise ValueError(f"margin {margin_s} s must be under the look-back {lookback_s} s")
        self.lookback_s = lookback_s
        self.margin_s = margin_s
        self.band_s = band_s
        self._clock = clock
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._fast_from = 0.0  # the next fast read: stamps above this
        self._band_from = 0.0  # stamps up to this were read by a band, a full read, or both
        self._last_now = 0.0
        self._last_tick = 0.0  # the monotonic clock at _last_now

    def reset(self, at: float) -> None:
        """A full read of what the reader follows began at `at` (the reader's clock):
        every write visible then is known, and every write stamped `lookback_s` before
        it was visible then."""
        with self._lock:
            self._fast_from = at - self.margin_s
            self._band_from = at - self.lookback_s
            self._last_now, self._last_tick = at, self._monotonic()

    def read(self, fetch: Fetch[T]) -> list[T]:
        """The records written since the last read (and perhaps a few read before), by one
        or two calls of `fetch`. Nothing moves on unless every call returned."""
        with self._lock:
            now, tick = self._clock(), self._monotonic()
            fast_from, band_from = self._fast_from, self._band_from
            if now < self._last_now:  # the clock stepped back: stamps from here on are lower
                lowest = now - (tick - self._last_tick)  # its reading just after the step
                fast_from = min(fast_from, lowest - self.lookback_s)
                band_from = min(band_from, lowest - self.lookback_s)
            found = list(fetch(fast_from, None))
            settled = now - self.lookback_s  # every write stamped up to here has landed
            if settled - band_from >= self.band_s:
                if fast_from > band_from:  # what the fast read did not cover
                    found.extend(fetch(band_from, min(settled, fast_from)))
                band_from = settled
            self._fast_from = now - self.margin_s
            self._band_from = band_from
            self._last_now, self._last_tick = now, tick
            return found
