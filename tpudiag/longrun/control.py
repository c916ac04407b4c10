"""The process-wide channel between what notices something (triggers, probes, the manual trigger, the numerics
checker, the compile collector) and what acts on it (the trace collector's windows, the numerics collector).

Everything here is plain Python state touched from the training thread (and, for ``request``, from any thread):
appending to a list and reading a flag are atomic under the GIL, so no lock sits on the per-step path.  When no
capture with windows runs in this process (``active`` false) requests are dropped and nothing is recorded.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

REASONS = (
    "first_steps",
    "schedule",
    "slow_step",
    "recompile",
    "graph_break",
    "nonfinite",
    "memory",
    "numerics",
    "manual",
    "whole_run",
)
TRIGGER_REASONS = ("slow_step", "recompile", "graph_break", "nonfinite", "memory", "numerics", "manual")


@dataclass(frozen=True)
class WindowRequest:
    """Open a window over the next ``steps`` steps (None: the capture's default) for ``reason``."""

    reason: str
    steps: int | None = None
    numerics: bool = True  # every op checked in the window's steps (within --budget)
    detail: str | None = None


class _State:
    def __init__(self) -> None:
        self.active = False
        self.pending: list[WindowRequest] = []
        self.numerics_wanted = False  # a window that wants every op checked covers the coming step
        self.window_open = False  # a trace window covers the coming step (the memory growth watch skips it)
        self.compiles = 0
        self.recompiles = 0
        self.graph_breaks = 0
        self.compile_detail: str | None = None


_state = _State()
STATE = _state  # the same object for the whole process (reset in place): the pulse reads its counters without a call


def activate() -> None:
    """A capture with trace windows starts in this process."""
    counts = _state.compiles, _state.recompiles, _state.graph_breaks  # "so far in this process": kept
    _state.__init__()  # type: ignore[misc]
    _state.compiles, _state.recompiles, _state.graph_breaks = counts
    _state.active = True


def deactivate() -> None:
    _state.active = False
    _state.pending = []
    _state.numerics_wanted = False
    _state.window_open = False


def active() -> bool:
    return _state.active


def request(reason: str, steps: int | None = None, numerics: bool = True, detail: str | None = None) -> bool:
    """Ask for a window at the next step boundary; False when no capture with windows runs here."""
    if reason not in REASONS:
        raise ValueError(f"unknown window reason {reason!r} (one of {', '.join(REASONS)})")
    if not _state.active:
        return False
    _state.pending.append(WindowRequest(reason, steps, numerics, detail))
    return True


def requested() -> bool:
    """Whether a request waits to be taken."""
    return bool(_state.pending)


def take() -> list[WindowRequest]:
    """The requests made since the last call (oldest first)."""
    if not _state.pending:
        return []
    taken, _state.pending = _state.pending, []
    return taken


def set_numerics_wanted(on: bool) -> None:
    _state.numerics_wanted = on


def numerics_wanted() -> bool:
    return _state.numerics_wanted


def set_window_open(on: bool) -> None:
    _state.window_open = on


def window_open() -> bool:
    return _state.window_open


def compile_event(kind: str, detail: str | None = None) -> None:
    """The compile collector saw an event (``compile``, ``recompile``, ``graph_break``...): counted for the pulse."""
    if kind == "recompile":
        _state.recompiles += 1
        _state.compile_detail = detail
    elif kind == "graph_break":
        _state.graph_breaks += 1
        _state.compile_detail = detail
    if kind in ("compile", "recompile", "backward_compile", "graph_break"):
        _state.compiles += 1


def compile_counts() -> tuple[int, int, int]:
    """(compile events, recompiles, graph breaks) so far in this process."""
    return _state.compiles, _state.recompiles, _state.graph_breaks


def compile_detail() -> str | None:
    return _state.compile_detail


# The numerics checker's budget (``collectors/numerics/sampling.Budget``), read by the pulse at each step's end: its
# own seconds so far (its dispatch mode's time on the script's calls, checks included) are ``extra_s +
# per_op_overhead_s * ops_seen`` (``Budget.own_s``, which the pulse sums without the call: one cold frame fewer a
# step).  A step's checker time is tpudiag's own time, never the script's slowness.
checker_budget: Any = None


def set_checker_budget(budget: Any) -> None:
    global checker_budget
    checker_budget = budget


def checker_seconds() -> float:
    """Seconds the numerics checker has spent so far in this process (0 without one)."""
    budget = checker_budget
    if budget is None:
        return 0.0
    try:
        return float(budget.own_s())
    except Exception:
        return 0.0


# tpudiag's background threads in the script's process (the collectors' flusher, the pulse writer) hold the GIL for
# milliseconds at a time, and the script's thread waits: 6-26 ms steps every 5-10 s on a 1.5 ms loop, twice within 16
# steps often enough to fire slow_step windows of tpudiag's making.  Their work's cumulative ns (work in progress
# included) is read by the pulse at each step's end, and a step is judged without the part of it they overlapped.
_bg_lock = threading.Lock()
bg_done_ns = 0
bg_running: dict[int, int] = {}  # thread id -> when its current unit of work began


@contextlib.contextmanager
def background_work() -> Iterator[None]:
    """Around one unit of a background thread's work (a flush, a write)."""
    global bg_done_ns
    key, t0 = threading.get_ident(), time.perf_counter_ns()
    with _bg_lock:
        bg_running[key] = t0
    try:
        yield
    finally:
        with _bg_lock:  # the total first: a reader that finds no unit running then finds this one counted
            bg_done_ns += time.perf_counter_ns() - t0
            bg_running.pop(key, None)


def background_ns() -> int:
    """Nanoseconds tpudiag's background threads have worked so far in this process (a unit in progress counts up
    to now)."""
    if not bg_running:  # most steps: no unit in progress, and reading an int is atomic under the GIL (no lock)
        return bg_done_ns
    now = time.perf_counter_ns()
    with _bg_lock:
        return bg_done_ns + sum(now - t0 for t0 in bg_running.values())
