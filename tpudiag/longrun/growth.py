"""When memory growth asks for a ``memory`` trace window (pure: the figures are passed in).

Growth is judged on the *lowest* live bytes of each run of ``span`` steps (on fast steps the latest reading, taken
every 0.5 s: ``tpudiag.longrun.stride``), not on single readings: a trace window,
a checked stretch or one large temporary raises a reading for a few steps and falls back, while a leak raises the
floor under every step.  Judging single readings set off ``memory`` windows of tpudiag's own making (each window's
profiler and checker memory lifted the host RSS past the threshold, and the next window did it again).

A span's low is compared with the lowest span low seen after warm-up: growth past ``factor`` times that floor, and
by at least ``min_bytes``, asks for a window; once one is granted the floor moves up to the new low, so the next
window needs as much growth again.

A trace window may leave memory behind that is tpudiag's (a window with every op checked once left the host's RSS
~90 MB higher for good), and a leak of the script's may be what opened the window (its allocations slow the steps
down: ``slow_step``).  The readings inside a window are not judged.  After it, two spans are read: the first
span's low ``a`` against the last reading ``before`` the window is the step the window left, and the second
span's low ``b`` against ``a`` is the script's own rate.  The floor moves up by what the window left less what the
script grew at that rate over the same steps; then ``b`` is judged.  So a window's leftover is never a leak, and a
leak that keeps opening windows is still found on the second span after each (an earlier version skipped a span
and absorbed all growth across it: a leak that opened ``slow_step`` windows every few dozen steps hid under them).

Held readings (issue 21: the memory collector's per-step cost).  On fast steps the reading is held for ~100 steps
between two samples, and ``see`` on such a step only counts it.  After each ``see`` outside a window, ``quiet`` is
how many more steps of the same reading outside a window would decide nothing (the span does not close in them
and does not begin in them): the caller may count such a step as ``pending`` (``quiet -= 1; pending += 1``) instead
of calling ``see``, which takes the pending steps in first, exactly as if each had been seen.
"""

from __future__ import annotations

from dataclasses import dataclass

FACTOR = 1.25
MIN_BYTES = 64 << 20
SPAN_STEPS = 16


@dataclass
class GrowthWatch:
    factor: float = FACTOR
    min_bytes: int = MIN_BYTES
    span: int = SPAN_STEPS
    floor: int | None = None
    _low: int | None = None
    seen: int = 0  # readings in the current span
    _steps: int = 0  # readings seen, in windows too
    _prev: tuple[int, int] | None = None  # (step, live) of the last reading outside a window
    _before: tuple[int, int] | None = None  # the last reading before the window that is open or being read after
    _first: tuple[int, int] | None = None  # (first step, low) of the first span after that window
    _in_window: bool = False
    held: int | None = None  # the reading of the last ``see`` outside a window
    quiet: int = 0  # steps of ``held`` outside a window that may be counted as ``pending`` (see the docstring)
    pending: int = 0

    def see(self, live: int, in_window: bool = False) -> int | None:
        """One step's live bytes (``in_window``: a trace window covers the step); the span's low when it closes
        grown past the floor (ask for a window), else None."""
        if self.pending:
            self._take_pending()
        low = self._see(live, in_window)
        self.held = None if in_window else live
        self.quiet = self.span - 1 - self.seen if self.seen and not in_window else 0
        return low

    def _take_pending(self) -> None:
        """The steps counted as ``pending``: each a step of ``held`` outside a window that closed no span (the span's
        low already holds ``held``: it was seen on the step before them)."""
        assert self.held is not None
        n, self.pending = self.pending, 0
        self._steps += n
        self._prev = (self._steps, self.held)
        self.seen += n

    def _see(self, live: int, in_window: bool) -> int | None:
        self._steps += 1
        if in_window != self._in_window:
            self._window_edge(in_window)
        if in_window:
            return None
        self._prev = (self._steps, live)
        self._low = live if self._low is None else min(self._low, live)
        self.seen += 1
        if self.seen < self.span:
            return None
        low, self._low, self.seen = self._low, None, 0
        if self._before is not None:
            if self._first is None:
                self._first = (self._steps - self.span + 1, low)  # the step the window left: read on the next span
                return None
            self._absorb(low)
        if self.floor is None or low < self.floor:
            self.floor = low
            return None
        return low if self.past_threshold(low) else None

    def past_threshold(self, live: int) -> bool:
        """``live`` bytes have grown past the floor by the factor and by ``min_bytes`` (a window's worth)."""
        floor = self.floor
        return floor is not None and live > floor * self.factor and live - floor >= self.min_bytes

    def granted(self, low: int) -> None:
        """A window was opened for ``low``: the next one needs as much growth again."""
        self.floor = low

    def _absorb(self, second: int) -> None:
        """Raise the floor by what the window left behind: the first span's low over the last reading before the
        window, less the script's own growth at the rate of the first span to the second."""
        assert self._before is not None and self._first is not None
        (before_step, before), (first_step, first) = self._before, self._first
        rate = max(second - first, 0) / self.span
        left = first - before - rate * (first_step - before_step)
        if self.floor is not None and left > 0:
            self.floor += int(left)
        self._before = self._first = None

    def _window_edge(self, in_window: bool) -> None:
        if in_window and self._before is None:  # windows back to back: the reading before the first of them
            self._before = self._prev
        if in_window:
            self._first = None  # a span being read after an earlier window is cut by this one
        self._low, self.seen = None, 0
        self._in_window = in_window
