"""Steady steps: the common step of a long run costs two timestamps, and the collectors take them in batches
(issue 21: the pulse costs at most about 1% of a fast step).

Between trace windows, on most steps of a long training loop, every collector that acts at a step's boundaries
decides nothing: the pulse appends a record and compares the step's period with a threshold, the memory collector
sees its clock not due, the numerics collector counts a step it does not watch.  That work is small, but it runs on
a step whose caches the script has just filled: every object it touches is a cache miss, every call a cold frame.
Measured on the long-run bench's 1.4 ms step, the hooks cost ~36 us a step, of which ~8 us is the floor of two
hooks that only take timestamps.

So after every step that ran the collectors' full boundary work, each collector says how many of the next steps it
would find quiet and until when (``Part.horizon``: its counters and clocks, the window plan's schedule, the
numerics schedule's next re-check step, the memory stride's next reading, the gradient check to read).  Within
that horizon a step is *steady* when:

- its root module call is the same module's, on the main thread, with inputs of the same shapes and dtypes as the
  last full step's (``key``): the wrapper in ``module_calls`` appends the call's start and skips the listeners;
- its end is the leading optimizer's step on the main thread, with no compile event, no window request and a
  period under the slow-step threshold since the last step's end: ``step_points`` appends the end and skips the
  callbacks.

Steps ended by root calls (a serving or generation loop, an evaluation between training steps:
``collectors/root_steps.py``) are steady the same way (``Gate.byroot``): after a full root call that ended a step
(``step_points.end_without_optimizer``, then ``reopen(by_root=True)`` once every listener has entered it), a root
call of the same module, on the main thread and outside any backward, with inputs of the same shapes and dtypes,
within the horizon and under the slow-step threshold since the last step's end, ends the step in progress and begins
the next in one timestamp and enters no listener.  Measured on a 7-layer MLP served under ``no_grad`` (~0.65 ms a
call on a slow VM), every root call had taken the full path: ~78 us a call, 12% of the loop.

Anything else (a slow period, a recompile, a trigger from another thread or process, new input shapes, a second
root call inside the step, the horizon reached) takes the full path, which first hands the steady steps to the
collectors (``settle``: each ``Part.absorb`` takes them in one pass, as if each had ended on its own quiet path)
and then runs as before.  So the pulse keeps a record for every step, the numerics checker's schedule and the
memory stride are kept to the step, and a trigger fires on the step it concerns; what a steady step does not
carry is tpudiag's own time of its two checks (~1-2 us), which its record leaves out.

``TPUDIAG_STEADY=0`` turns it off (every step takes the full path).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Protocol

import torch

from tpudiag import internal_errors
from tpudiag.collectors import root_steps

MAX_STEPS = 256  # steady steps held before the collectors take them, whatever the horizons say (~1 s of 5 ms steps)
_Tensor = torch.Tensor
_SCALARS = (type(None), bool, int, float, str)


class Part(Protocol):
    """What a collector that acts at step ends gives the gate."""

    def horizon(self, gate: Gate) -> None:
        """After a full step end: narrow ``gate`` (``Gate.limit``, ``Gate.shut``) to the steps this part would
        find quiet."""

    def absorb(self, starts: list[int], ends: list[int]) -> None:
        """Steady steps (``perf_counter_ns`` of each one's root call and end), in order, as if each had ended on
        the part's quiet path."""

    def resume(self, start: int) -> None:
        """A steady step's root call began at ``start`` and its end has not come (it will take the full path)."""


class Gate:
    """Where the fast paths read whether a step may be steady; the steady steps not yet settled."""

    __slots__ = ("began_ns", "begun", "byroot", "cls", "compiles", "ends", "key", "last_end", "left", "long_ns",
                 "module_id", "ready", "root_ended", "slow_ns", "starts", "steady", "until_ns")  # fmt: skip

    def __init__(self) -> None:
        self.left = 0  # steady step ends allowed before a full one (0: every step is full)
        self.until_ns = 0  # ... and until this ``perf_counter_ns``
        self.slow_ns: float = 0.0  # a period (end to end) over this is judged on the full path
        self.last_end = 0  # the last step's end
        self.compiles = -1  # ``control.STATE.compiles`` at the last full step end
        self.module_id = 0  # id() of the root module whose calls begin steady steps ...
        self.cls: type[Any] | None = None  # ... and its class (an id may be reused once the module is gone)
        self.key: tuple[Any, ...] | None = None  # its inputs' key at the last full step's root call
        self.ready = False  # a step ended and no root call came since: the next may begin a steady step
        self.begun = False  # the step in progress began with a steady root call (its end may be steady too)
        self.long_ns = 0  # a root call this long after its step's start may end the step (``root_steps``)
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.steady = 0  # steady steps so far (tests, notes)
        # Steps ended by root calls (see the module's docstring): the steady steps held are such steps, and a root
        # call that repeats the last full one's ends the step in progress.  Read by the parts' ``horizon`` and
        # ``absorb`` too (set before the first, cleared after the second).
        self.byroot = False
        self.root_ended = False  # a root call's listeners ended a step (``step_points.end_without_optimizer``)
        self.began_ns = 0  # the start of the step the last full root call began (``began_full``)

    def limit(self, steps: int, until_ns: float) -> None:
        if steps < self.left:
            self.left = max(steps, 0)
        if until_ns < self.until_ns:
            self.until_ns = int(until_ns)

    def shut(self) -> None:
        """No steady step until the next full step end (another thread asked for something)."""
        self.left = 0


gate = Gate()
_parts: tuple[Part, ...] = ()
_lock = threading.Lock()
_enabled = os.environ.get("TPUDIAG_STEADY", "1") not in ("0", "false", "no", "off")
_main_ident = threading.main_thread().ident


_MONOTONIC_OFFSET = time.monotonic() - time.perf_counter_ns() * 1e-9  # (one clock on Linux; an offset elsewhere)


def perf_ns(monotonic_s: float) -> float:
    """A ``time.monotonic()`` deadline on the fast paths' clock (``perf_counter_ns``)."""
    return (monotonic_s - _MONOTONIC_OFFSET) * 1e9


def set_parts(parts: tuple[Part, ...]) -> None:
    """The parts of the step-end callbacks (``step_points``); the gate shut until they have all said so."""
    global _parts
    with _lock:
        gate.left = 0
        _parts = parts


def key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    """A root call's inputs as the collectors see them (every tensor's shape and dtype, by position and keyword;
    plain scalars left out), or None when they hold anything else (lists, dicts, objects): such a step is never
    steady."""
    if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:
        return (args[0].shape, args[0].dtype)
    out: list[Any] = []
    for a in args:
        if isinstance(a, _Tensor):
            out.append((a.shape, a.dtype))
        elif not isinstance(a, _SCALARS):
            return None
    for name, v in kwargs.items():
        if isinstance(v, _Tensor):
            out.append((name, v.shape, v.dtype))
        elif not isinstance(v, _SCALARS):
            return None
    return tuple(out)


def began_full(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], start: int = 0) -> None:
    """A step began on the full path with this root call (at ``start``, ``perf_counter_ns``): the next steady steps
    must repeat it."""
    gate.began_ns = start
    k = key(args, kwargs) if _enabled else None
    gate.module_id = id(module) if k is not None else 0  # (0: no module's id; inputs without a key are never steady)
    gate.cls = type(module)
    gate.key = k


def settle() -> None:
    """The steady steps so far to the collectors (before anything else reads or changes their state)."""
    starts, ends = gate.starts, gate.ends
    if not starts:
        return
    gate.starts, gate.ends = [], []
    n = len(ends)
    begun = gate.begun
    gate.begun = False
    for part in _parts:
        try:
            if n:
                part.absorb(starts[:n], ends)
            if begun and len(starts) > n:
                part.resume(starts[n])
        except Exception as err:
            internal_errors.current().record("steady steps", type(part).__name__, err)


def reopen(by_root: bool = False) -> None:
    """After a full step end (its callbacks run): the horizon of every part.  ``by_root``: the step ended at a root
    call, which began the next one (``reopen_by_root``)."""
    g = gate
    g.left = 0
    g.ready = False
    g.byroot = by_root
    if not _enabled or not _parts:
        return
    g.left, g.until_ns = MAX_STEPS, 1 << 62
    g.long_ns = int(root_steps.LONG_STEP_S * 1e9)  # (the shortest limit: ``RootSteps.begins``)
    for part in _parts:
        try:
            part.horizon(g)
        except Exception as err:
            g.left = 0
            internal_errors.current().record("steady steps", type(part).__name__, err)
        if not g.left:
            return
    g.ready = True


def reopen_by_root() -> None:
    """After a root call whose listeners ended a step and began the next (``module_calls``, once they have all
    entered it): the next root calls of the same module may end steps steadily.  The step in progress is held as a
    steady step begun at its full start (``began_full``), so the parts take it in ``absorb`` with the others."""
    g = gate
    g.root_ended = False
    reopen(by_root=True)
    if not g.ready or not g.began_ns or g.starts:
        g.left = 0
        g.ready = False
        g.byroot = False
        return
    g.ready = False
    g.starts, g.ends = [g.began_ns], []
    g.begun = True


def close() -> None:
    """No steady step from now on, and those held handed over (a capture that stops, a step ended by a root call)."""
    gate.left = 0
    gate.ready = False
    settle()
    gate.byroot = False
    gate.module_id, gate.cls, gate.key = 0, None, None


def let_go_in_child() -> None:
    """In a forked child: nothing held, nothing handed over (the parent's collectors are not the child's)."""
    global _parts
    gate.left = 0
    gate.starts, gate.ends, gate.begun, gate.ready = [], [], False, False
    gate.byroot = gate.root_ended = False
    gate.module_id, gate.cls, gate.key = 0, None, None
    _parts = ()
