"""Per-step readings thinned out on fast steps (issue 21: the pulse costs at most about 1% of a step).

A reading that touches the device or the kernel (the pulse's gradient check, the memory collector's sample) costs
10-50 us on a step whose caches the script has just filled, and it makes its step a full one (``steady_steps``: the
collectors' step-end work, ~300 us on the long-run bench's slow VM, where a steady step takes two timestamps).  So,
after the first window's steps (every step read, as a short script always was), a reading is taken only when
``every_s`` (0.5 s) has passed since the last one: every step of a job whose steps take 0.5 s or more, about one step
in a hundred of a 5 ms loop.  (Every 50 ms, the readings' full steps cost ~0.6% of the bench loop's time.)  A step
without a reading records None (unknown), never a copied value.

What a reading watches for lasts (a NaN in a gradient reaches every parameter through the update, a leak stays),
so a thinned reading finds it at most ``every_s`` later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tpudiag.longrun.schedule import FIRST_STEPS

EVERY_S = 0.5


@dataclass
class Stride:
    every_s: float = field(default_factory=lambda: EVERY_S)  # (read when made: a test may set the module's)
    first_steps: int = FIRST_STEPS
    _last: float = float("-inf")

    def due(self, step: int, now: float) -> bool:
        """Whether step ``step`` (0-based), ending at ``now`` (monotonic seconds), takes its reading."""
        if step >= self.first_steps and now - self._last < self.every_s:
            return False
        self._last = now
        return True

    def next_s(self) -> float:
        """From when (the clock ``due`` is given) a step past the first ones is due."""
        return self._last + self.every_s
