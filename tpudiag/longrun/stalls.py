"""Whether a slow step was the machine's: the step thread kept off its CPU (issue 21, no false alarms).

A step can be slow with nothing of the script's in it: the kernel ran another task on the step thread's CPU (a data
loader's workers, a neighbour's job, tpudiag's own helpers on a busy core) or the hypervisor took the VM's CPU away
(steal).  Such a step opened a ``slow_step`` window whose trace showed ordinary steps (the stall had passed), and
with it a window's numerics at full rate (on the 10-minute bench, session 39, one run opened four ``slow_step``
windows besides the planted one's: ~3.6 s, 0.6% of its throughput; what held those steps was not recorded).

Linux keeps both counts, read here without a syscall per step:

- the step thread's run-queue wait (``/proc/thread-self/schedstat``, second field: ns runnable but not running),
  read at each mark (``mark``: the pulse's reading clock, every ~0.5 s) and for each step over the slow threshold;
- the CPUs' steal (``/proc/stat``'s ``cpu`` line, eighth value, in clock ticks), read likewise but at most every
  ``STEAL_EVERY_S`` (on a host with hundreds of CPUs ``/proc/stat`` is long to build), as the share of one CPU
  (the sum over CPUs divided by their number: a stall of the whole VM counts in full, one of another vCPU only in
  part, so it is never overestimated for the step thread).

The counts since the last mark cover the slow step and the steps before it.  What the earlier steps had of it is
taken out at the rate of the marks before (``rate``: a machine that is always contended keeps a wait in every
step, and a step slow for the script's own reason is still slow once that ordinary share is taken out).  The rest
is the step's stall: ``held_ns``.  Elsewhere than Linux (no such files) it is always 0, and every slow step is
judged as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

STEAL_EVERY_S = 2.0
RATE_WEIGHT = 0.3  # the weight of the newest interval in a count's ordinary rate


class _Count:
    """One cumulative count (ns): its value at the last mark and its ordinary rate (ns a ns) between marks."""

    __slots__ = ("at", "rate", "read", "spoiled", "value")

    def __init__(self, read: Callable[[], float]) -> None:
        self.read = read
        self.at = 0  # perf_counter_ns of the last mark (0: none yet)
        self.value = 0.0
        self.rate: float | None = None
        self.spoiled = False  # a stall was found since the last mark: that interval does not teach the rate

    def mark(self, now_ns: int) -> None:
        value = self.read()  # (an OSError goes to ``StallClock``, which stops reading)
        if self.at and not self.spoiled and now_ns > self.at:
            rate = min(max((value - self.value) / (now_ns - self.at), 0.0), 1.0)
            self.rate = rate if self.rate is None else (1 - RATE_WEIGHT) * self.rate + RATE_WEIGHT * rate
        self.at, self.value, self.spoiled = now_ns, value, False

    def beyond(self, now_ns: int) -> float:
        """What it counted since the last mark beyond its ordinary rate (0 before the rate is known)."""
        if self.rate is None:
            return 0.0
        return self.read() - self.value - self.rate * (now_ns - self.at)


class StallClock:
    """The step thread's time held off its CPU (run-queue wait and steal) beyond the ordinary, between marks; made
    and read on the step thread (``/proc/thread-self`` is the thread that opens it)."""

    def __init__(self) -> None:
        self._counts: list[_Count] = []
        self._steal: _Count | None = None
        self._fds: list[int] = []
        self._opened = False
        self.stalls = 0  # slow steps found held (``found``)
        self.stalled_ns = 0

    def _open(self) -> None:
        self._opened = True
        try:
            fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            self._fds.append(fd)
            int(os.pread(fd, 128, 0).split()[1])
            self._counts.append(_Count(lambda: float(os.pread(fd, 128, 0).split()[1])))
        except (OSError, ValueError, IndexError):
            pass
        try:
            stat = os.open("/proc/stat", os.O_RDONLY)
            self._fds.append(stat)
            share = 1e9 / _clock_ticks() / max(os.cpu_count() or 1, 1)

            def steal() -> float:
                line = os.pread(stat, 512, 0).split(b"\n", 1)[0].split()
                return int(line[8]) * share if len(line) > 8 and line[0] == b"cpu" else 0.0

            steal()
            self._steal = _Count(steal)
            self._counts.append(self._steal)
        except (OSError, ValueError, IndexError):
            pass

    def mark(self, now_ns: int) -> None:
        """A reading at a step's end (``now_ns``: ``perf_counter_ns``): the base of the next ``held_ns``; the
        interval since the last one teaches the ordinary rates (unless it held a stall).  Steal at most every
        ``STEAL_EVERY_S``."""
        if not self._opened:
            self._open()
        try:
            for count in self._counts:
                if count is not self._steal or (now_ns - count.at) * 1e-9 >= STEAL_EVERY_S:
                    count.mark(now_ns)
        except (OSError, ValueError, IndexError):
            self._counts, self._steal = [], None  # (a file that stopped reading: no stall is found from now on)

    def held_ns(self, now_ns: int) -> int:
        """Of the step that ended at ``now_ns``, the ns the machine held its thread off the CPU beyond the ordinary
        since the last mark (0 before two marks have taught the rates, or where nothing can be read)."""
        try:
            return max(int(sum(count.beyond(now_ns) for count in self._counts)), 0)
        except (OSError, ValueError, IndexError):
            self._counts, self._steal = [], None
            return 0

    def close(self) -> None:
        """The files closed (the capture's end): no stall is found from now on."""
        self._counts, self._steal, self._opened = [], None, True
        fds, self._fds = self._fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def found(self, held_ns: int) -> None:
        """A slow step was the machine's: counted, and its interval kept from teaching the rates."""
        self.stalls += 1
        self.stalled_ns += held_ns
        for count in self._counts:
            count.spoiled = True


def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK")) or 100
    except (ValueError, OSError, AttributeError):
        return 100
