"""When a step is slow enough to open a window, and how often trigger windows may open (pure: no torch, no clock
of its own; times are passed in)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

SLOW_FACTOR = 4.0  # k: a step slower than k x the rolling median
SLOW_MIN_EXTRA_S = 0.005  # ... and at least this much slower (jitter of a millisecond step is not an anomaly)
MEDIAN_WINDOW = 64  # steps in the rolling median
MEDIAN_EVERY = 16  # the median is recomputed every this many steps (sorting 64 values costs a few microseconds)
WARMUP_STEPS = 100  # no trigger fires before this many steps (compiles, allocator growth, caches)
MIN_INTERVAL_S = 30.0  # between two trigger windows of one reason (a manual trigger is never held back)
MAX_PER_REASON = 20  # trigger windows of one reason in a run; then that reason only counts
# One outlier opens a window only when another came within REPEAT_WITHIN steps before it, or when it is FAR_FACTOR x
# the median: on a shared host isolated steps of 4-15x the median come every few seconds (the scheduler, a GC, the
# host's other work), and a 10-minute bench run spent all 20 slow_step windows on them before its planted run of
# 50x slow steps began.
REPEAT_WITHIN = 16
FAR_FACTOR = 25.0
# A trigger held back by the interval still opens its window when it is this many times as severe as the one that
# opened the last window of its reason (a slow step's severity: its multiple of the median).  A jitter window must
# not hide the real slowdown that follows within the interval (seen on the bench: a 5x outlier's window, then the
# planted 50x run 8 s later held back).  The count cap still holds.
ESCALATE = 3.0


@dataclass
class SlowSteps:
    """Rolling median of step durations; ``check`` says whether a step is an outlier."""

    factor: float = SLOW_FACTOR
    min_extra_s: float = SLOW_MIN_EXTRA_S
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=MEDIAN_WINDOW))
    median_s: float | None = None
    _since: int = 0
    _steps: int = 0
    _last_slow: int | None = None  # the step count at the last outlier (``fires``)

    def check(self, dur_s: float) -> bool:
        """Record a step; True when it is slower than ``factor`` x the median (outliers stay out of the median)."""
        median = self.median_s
        slow = median is not None and dur_s > self.factor * median and dur_s - median > self.min_extra_s
        if not slow:
            self.recent.append(dur_s)
            self._since += 1
            if (median is None and len(self.recent) >= 8) or self._since >= MEDIAN_EVERY:
                self._recompute()
        return slow

    def _recompute(self) -> None:
        ordered = sorted(self.recent)
        self.median_s = ordered[len(ordered) // 2]
        self._since = 0

    def threshold_s(self) -> float | None:
        """The duration above which a step is an outlier (``check``), or None while no median is known."""
        median = self.median_s
        if median is None:
            return None
        return max(self.factor * median, median + self.min_extra_s)

    def refresh(self) -> float | None:
        """The median of the recent steps, recomputed now (for a caller that appends to ``recent`` itself and asks
        ``fires`` only about steps over ``threshold_s``); the new threshold."""
        if len(self.recent) >= 8:
            self._recompute()
        return self.threshold_s()

    def fires(self, dur_s: float, step: int | None = None) -> bool:
        """``check``, and whether this outlier should open a window: it repeats one of the last ``REPEAT_WITHIN``
        steps, or it is ``FAR_FACTOR`` x the median.  (Every step of a run: the common step, not an outlier, is
        ``check``'s first branch inlined.)  ``step``: the step's index, where the caller does not call this for
        every step."""
        median = self.median_s
        self._steps = self._steps + 1 if step is None else step
        if median is not None and (dur_s <= self.factor * median or dur_s - median <= self.min_extra_s):
            self.recent.append(dur_s)
            self._since += 1
            if self._since >= MEDIAN_EVERY:
                self._recompute()
            return False
        if not self.check(dur_s):
            return False
        repeat = self._last_slow is not None and self._steps - self._last_slow <= REPEAT_WITHIN
        self._last_slow = self._steps
        return repeat or (median is not None and dur_s > FAR_FACTOR * median)


@dataclass
class RateLimit:
    """Trigger windows: per reason, at most one every ``min_interval_s`` seconds and ``max_per_reason`` in all (a
    run that keeps slowing does not trace for ever, and a slow-step window does not mask a recompile's)."""

    min_interval_s: float = MIN_INTERVAL_S
    max_per_reason: int = MAX_PER_REASON
    last_s: dict[str, float] = field(default_factory=dict)
    opened: dict[str, int] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)  # triggers that fired but opened no window, by reason
    severity: dict[str, float] = field(default_factory=dict)  # of the trigger that opened the last window, by reason

    def allow(self, reason: str, now_s: float, severity: float | None = None) -> bool:
        if reason != "manual":
            last = self.last_s.get(reason)
            too_soon = last is not None and now_s - last < self.min_interval_s
            before = self.severity.get(reason)
            if too_soon and severity is not None and before is not None and severity >= ESCALATE * before:
                too_soon = False
            if too_soon or self.opened.get(reason, 0) >= self.max_per_reason:
                self.held[reason] = self.held.get(reason, 0) + 1
                return False
        self.last_s[reason] = now_s
        self.opened[reason] = self.opened.get(reason, 0) + 1
        if severity is not None:
            self.severity[reason] = severity
        else:
            self.severity.pop(reason, None)
        return True
