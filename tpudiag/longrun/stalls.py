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

import os

from tpudiag.proc_field import ProcField

STEAL_EVERY_S = 2.0
RATE_WEIGHT = 0.3  # the weight of the newest interval in a count's ordinary rate


class _Unreadable(Exception):
    """A count's file stopped reading as expected: the clock stops (``StallClock.close``)."""


class _Count:
    """One cumulative count (ns): its value at the last mark and its ordinary rate (ns a ns) between marks."""

    __slots__ = ("at", "field", "rate", "scale", "spoiled", "value")

    def __init__(self, field: ProcField, scale: float) -> None:
        self.field, self.scale = field, scale  # ``scale``: ns per unit of the field
        self.at = 0  # perf_counter_ns of the last mark (0: none yet)
        self.value = self.read()
        self.rate: float | None = None
        self.spoiled = False  # a stall was found since the last mark: that interval does not teach the rate

    def read(self) -> float:
        value = self.field.read()
        if value is None:
            raise _Unreadable
        return value * self.scale

    def mark(self, now_ns: int) -> None:
        value = self.read()
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
        self._opened = False
        self.stalls = 0  # slow steps found held (``found``)
        self.stalled_ns = 0

    def _open(self) -> None:
        self._opened = True
        # /proc/stat's first line is "cpu user nice system idle iowait irq softirq steal ...": field 8 is the steal
        # of all CPUs together, in clock ticks; as one CPU's share, in ns.
        share = 1e9 / _clock_ticks() / max(os.cpu_count() or 1, 1)
        for path, index, scale, steal in (
            ("/proc/thread-self/schedstat", 1, 1.0, False),
            ("/proc/stat", 8, share, True),
        ):
            field = ProcField(path, index, size=512)
            try:
                count = _Count(field, scale)
            except _Unreadable:
                field.close()
                continue
            self._counts.append(count)
            if steal:
                self._steal = count

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
        except _Unreadable:
            self.close()

    def held_ns(self, now_ns: int) -> int:
        """Of the step that ended at ``now_ns``, the ns the machine held its thread off the CPU beyond the ordinary
        since the last mark (0 before two marks have taught the rates, or where nothing can be read)."""
        try:
            return max(int(sum(count.beyond(now_ns) for count in self._counts)), 0)
        except _Unreadable:
            self.close()
            return 0

    def close(self) -> None:
        """The files closed (the capture's end, or one stopped reading): no stall is found from now on."""
        counts, self._counts, self._steal, self._opened = self._counts, [], None, True
        for count in counts:
            count.field.close()

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
