"""One optimizer post-hook for every collector that acts at a step's end (issue 21: the pulse's per-step cost).

The memory collector's reading, the trace collector's pulse and window plan, and the numerics collector's step
boundary each registered a global optimizer post-hook of their own.  Each paid its entry from torch's hook loop, its
own ``torch.compiler.is_compiling()`` and thread checks, and inside a training step whose caches the script has
just filled every such call is a cache miss: 1-2 us each on the long-run bench's 1.5-2.5 ms step, where the whole
pulse may cost 1%.  Here one hook, registered with the first callback and removed with the last, checks once and
calls the callbacks in a fixed order:

- ``READ``: readings the step's pulse record carries (the memory collector's sample, published to
  ``tpudiag.longrun.probes``);
- ``PULSE``: the trace collector (the step's record, its triggers, the window plan);
- ``FOLLOW``: what acts on the plan's decision for the next step (the numerics collector watches a trigger window's
  first step).

Steps end at the steps of one optimizer (``_leads``): the first to step, until another steps twice without it in
between.  The other optimizers' steps fall inside steps, and their hooks call nothing.  A callback gets the
optimizer.  In a script without an optimizer step (serving, generation, evaluation) the trace
collector ends steps at its root module's calls instead (``collectors/root_steps.py``): ``end_without_optimizer``
calls the callbacks added with ``by_root`` (the memory reading and the pulse; the numerics collector makes its own
root-forward steps) with None for the optimizer.  ``main_thread_only`` callbacks are skipped when a step ends on
another thread.  One that raises is recorded in ``tpudiag.internal_errors`` and the others still run.  While Dynamo
traces a compiled optimizer step the hook changes nothing and calls nothing: it reads the steady gate first (the
common step's test), then returns on the compiling flag (and Dynamo skips its frame and all it calls): the hook dict
it guards on holds the same single hook for the whole capture.

Steady steps (``collectors/steady_steps.py``): while every callback's part says its quiet path would run, the
leading optimizer's step end only appends a timestamp; the first full step end after them hands them to the parts
(``settle``) before the callbacks run, and then asks the parts for the next horizon (``reopen``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tpudiag import forks, internal_errors
from tpudiag.collectors import module_calls, steady_steps
from tpudiag.longrun import control

READ = 0
PULSE = 10
FOLLOW = 20

Callback = Callable[[Any], None]

_lock = threading.Lock()
_callbacks: tuple[tuple[Callback, bool, str], ...] = ()  # (callback, main_thread_only, name), in order
_by_root: tuple[tuple[Callback, str], ...] = ()  # the callbacks added with ``by_root``, in the same order
# (order, serial, callback, main_thread_only, name, by_root, steady part): their source
_entries: list[tuple[int, int, Callback, bool, str, bool, steady_steps.Part | None]] = []
_serial = 0
_hook: Any = None  # torch's handle of the one registered hook
_forget_child: forks.ChildHook | None = None  # ``_let_go_in_child`` registered with ``tpudiag.forks``
_main_ident = threading.main_thread().ident
# Steps end at the steps of one optimizer (``_leads``).  A script that steps several per iteration (Muon on the
# matrices and AdamW on the rest, dense and sparse optimizers, a GAN's two) or wraps one optimizer in another (ZeRO,
# Lookahead: the inner step's hook fires, then the outer's) had a step per optimizer step: the iteration's number
# doubled, and a step that holds nothing but another optimizer's update sat between every two real ones.
_leader = 0  # id() of the optimizer whose steps end steps
_inside: set[int] = set()  # ids of the other optimizers that stepped since the last step end
# A bound on them: a script that makes a new optimizer every step and keeps the old ones alive (ids never repeat)
# would otherwise never end a step (and never close a trace window); it gets a step per MAX_INSIDE + 1 of its steps.
MAX_INSIDE = 16
_gate = steady_steps.gate
_STATE = control.STATE
_get_ident = threading.get_ident
_perf_counter_ns = time.perf_counter_ns
_compiling = module_calls.compiling


def _reorder() -> None:
    """``_callbacks`` and ``_by_root`` from ``_entries``: by order, then as added (under ``_lock``)."""
    global _callbacks, _by_root
    ordered = sorted(_entries, key=lambda e: (e[0], e[1]))
    _callbacks = tuple((fn, main, name) for _, _, fn, main, name, _root, _part in ordered)
    _by_root = tuple((fn, name) for _, _, fn, _main, name, root, _part in ordered if root)
    # Steady steps only while every callback has a part that says when its quiet path would run.
    parts = tuple(e[6] for e in ordered)
    steady_steps.set_parts(tuple(p for p in parts if p is not None) if None not in parts else ())


@dataclass(frozen=True)
class StepEndHandle:
    serial: int

    def remove(self) -> None:
        global _hook, _forget_child, _leader
        steady_steps.close()  # every collector takes the steady steps before the first of them stops
        with _lock:
            _entries[:] = [e for e in _entries if e[1] != self.serial]
            _reorder()
            if not _entries and _hook is not None:
                hook, _hook = _hook, None
                hook.remove()
                _leader = 0  # (the next capture in this process learns its own)
                _inside.clear()
                if _forget_child is not None:
                    _forget_child.remove()
                    _forget_child = None


def add(
    callback: Callback,
    order: int,
    name: str,
    main_thread_only: bool = True,
    by_root: bool = False,
    steady: steady_steps.Part | None = None,
) -> StepEndHandle:
    """Call ``callback(optimizer)`` at the end of every optimizer step, after the callbacks of lower ``order`` (and
    of the same order added before it); with ``by_root``, also ``callback(None)`` at every step end of a script
    without an optimizer step (``end_without_optimizer``).  ``steady``: what says when the callback would take its
    quiet path and takes steady steps in batches (``collectors/steady_steps.py``); while a callback has none,
    every step is full."""
    global _hook, _serial, _forget_child
    with _lock:
        if _hook is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _hook = register_optimizer_step_post_hook(module_calls.skip_in_dynamo(_on_step_end))
            _forget_child = forks.on_child("step hooks", _let_go_in_child)
        _serial += 1
        _entries.append((order, _serial, callback, main_thread_only, name, by_root, steady))
        _reorder()
        return StepEndHandle(_serial)


def _on_step_end(optimizer: Any, args: Any, kwargs: Any) -> None:
    gate = _gate
    if gate.begun and id(optimizer) == _leader and gate.left and not gate.byroot and _get_ident() == _main_ident:
        # A steady step's end (``collectors/steady_steps.py``): its end taken, no callback called.  Tested first,
        # the compiling flag last (reading the gate is harmless while Dynamo traces: it skips this frame).
        end = _perf_counter_ns()
        state = _STATE
        if (
            end < gate.until_ns
            and end - gate.last_end <= gate.slow_ns
            and state.compiles == gate.compiles
            and not state.pending
            and not _compiling._is_compiling_flag
        ):
            if _inside:
                _inside.clear()
            gate.ends.append(end)
            gate.last_end = end
            gate.begun = False
            gate.ready = True
            gate.left -= 1
            gate.steady += 1
            return
    if _compiling._is_compiling_flag:  # ``torch.compiler.is_compiling()``, without its frames
        return
    main = _get_ident() == _main_ident
    if not main:
        gate.shut()  # (another thread's optimizer never leads: the main thread's steps would end nowhere)
    elif id(optimizer) == _leader:
        if _inside:
            _inside.clear()
    elif not _leads(id(optimizer)):
        return  # another optimizer's step, inside the step
    if main and gate.starts:
        steady_steps.settle()
    for callback, main_only, name in _callbacks:
        if main_only and not main:
            continue
        try:
            callback(optimizer)
        except Exception as err:  # never into the user's optimizer step
            internal_errors.current().record("step hooks", name, err)
    if main:
        steady_steps.reopen()


def _let_go_in_child() -> None:
    """In a child forked from the capture (``tpudiag.forks``): the hook off, no callback (no lock taken)."""
    global _lock, _hook, _callbacks, _by_root
    _lock = threading.Lock()
    steady_steps.let_go_in_child()
    hook, _hook = _hook, None
    _entries.clear()
    _callbacks, _by_root = (), ()
    if hook is not None:
        hook.remove()


def _leads(key: int) -> bool:
    """A step of an optimizer other than the leading one: whether it ends the step, and leads from now on.  It does
    when it is the run's first optimizer step, or when this optimizer has already stepped since the last step end
    (the leading one no longer steps: a phase with another optimizer, an optimizer made anew), or after
    ``MAX_INSIDE`` other optimizers' steps."""
    global _leader
    if not _leader or key in _inside or len(_inside) >= MAX_INSIDE:
        _leader = key
        _inside.clear()
        return True
    _inside.add(key)
    return False


def end_without_optimizer() -> None:
    """A step's end in a script without an optimizer step (``collectors/root_steps.py``, on the main thread, never
    while Dynamo traces): the ``by_root`` callbacks, with None for the optimizer."""
    steady_steps.close()  # (no steady step without an optimizer step: any held go to the collectors first)
    for callback, name in _by_root:
        try:
            callback(None)
        except Exception as err:  # never into the user's forward
            internal_errors.current().record("step hooks", name, err)
    _gate.root_ended = True  # (``module_calls`` reopens the steady steps once every listener has entered the call)
