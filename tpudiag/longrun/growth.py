"""When memory growth asks for a ``memory`` trace window (pure: the figures are passed in).

Growth is judged on the *lowest* live bytes of each run of ``span`` steps (on fast steps the latest reading, taken
every 10 ms: ``tpudiag.longrun.stride``), not on single readings: a trace window,
a checked stretch or one large temporary raises a reading for a few steps and falls back, while a leak raises the
floor under every step.  Judging single readings set off ``memory`` windows of tpudiag's own making (each window's
profiler and checker memory lifted the host RSS past the threshold, and the next window did it again).

A span's low is compared with the lowest span low seen after warm-up: growth past ``factor`` times that floor, and
by at least ``min_bytes``, asks for a window; once one is granted the floor moves up to the new low, so the next
window needs as much growth again.
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

    def see(self, live: int) -> int | None:
        """One step's live bytes; the span's low when it closes grown past the floor (ask for a window), else
        None."""
        self._low = live if self._low is None else min(self._low, live)
        self.seen += 1
        if self.seen < self.span:
            return None
        low, self._low, self.seen = self._low, None, 0
        if self.floor is None or low < self.floor:
            self.floor = low
            return None
        if low > self.floor * self.factor and low - self.floor >= self.min_bytes:
            return low
        return None

    def granted(self, low: int) -> None:
        """A window was opened for ``low``: the next one needs as much growth again."""
        self.floor = low
