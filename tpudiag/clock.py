"""The clock seam: every duration tpudiag records comes through a Clock, so tests can assert exact values."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def wall(self) -> float:
        """Seconds since the epoch."""
        ...

    def monotonic(self) -> float:
        """Seconds on a monotonic clock (differences only)."""
        ...


class SystemClock:
    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.perf_counter()


class FakeClock:
    """A clock that only moves when told to."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._wall = start
        self._mono = 0.0

    def advance(self, seconds: float) -> None:
        self._wall += seconds
        self._mono += seconds

    def wall(self) -> float:
        return self._wall

    def monotonic(self) -> float:
        return self._mono
