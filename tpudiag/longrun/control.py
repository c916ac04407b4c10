"""The process-wide channel between what notices something (triggers, probes, the manual trigger, the numerics
checker, the compile collector) and what acts on it (the trace collector's windows, the numerics collector).

Everything here is plain Python state touched from the training thread (and, for ``request``, from any thread):
appending to a list and reading a flag are atomic under the GIL, so no lock sits on the per-step path.  When no
capture with windows runs in this process (``active`` false) requests are dropped and nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
        self.compiles = 0
        self.recompiles = 0
        self.graph_breaks = 0
        self.compile_detail: str | None = None


_state = _State()


def activate() -> None:
    """A capture with trace windows starts in this process."""
    global _state
    _state = _State()
    _state.active = True


def deactivate() -> None:
    _state.active = False
    _state.pending = []
    _state.numerics_wanted = False


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


# The numerics checker's cumulative own seconds (its dispatch mode's time on the script's calls, checks included),
# read by the pulse at each step's end: a step's checker time is tpudiag's own time, never the script's slowness.
_checker_clock: Callable[[], float] | None = None


def set_checker_clock(clock: Callable[[], float] | None) -> None:
    global _checker_clock
    _checker_clock = clock


def checker_seconds() -> float:
    """Seconds the numerics checker has spent so far in this process (0 without one)."""
    clock = _checker_clock
    if clock is None:
        return 0.0
    try:
        return float(clock())
    except Exception:
        return 0.0
