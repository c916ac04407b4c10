"""The pulse: one small record for every step of the run, always on (issue 21).

Per step: wall time (first root-module forward to the end of the optimizer step), the gap since the previous step
(data wait and whatever runs between steps), tpudiag's own time in its hooks, the root module's input shapes, compile
events, whether a gradient was non-finite, and the figures of registered per-step probes (``tpudiag.longrun.probes``:
memory, plugins).

Cost, on the common step: three ``perf_counter_ns`` calls, a few counters read, the step's period compared with a
precomputed threshold (the rolling median's, updated every 16 steps), one tuple appended; and at most every
50 ms one small device op (``tpudiag.longrun.stride``: every step of the first window's steps and of steps of 50 ms
or more).  Non-finiteness is read without a sync (and not inside trace windows, whose traces hold the script's ops
only): a checked step sums the gradient of its smallest parameter on the device (every ``FULL_EVERY`` checks: the
norms of all gradients), below every dispatch mode, and the result is read at the *next* step's end (or, after
steady steps, at the next full one: ``collectors/steady_steps.py``), when it is long done: on the CPU reading is
free, on CUDA only once its event has completed, on other devices (TPU) never during the run (the figure reads None:
an ``.item()`` would change the program).  A NaN in any gradient reaches
every parameter through the update, so the one small gradient sees it at the next check; the periodic full check
covers the rest.

Most steps of a long run are steady (``collectors/steady_steps.py``): their root call and their end only take a
timestamp, and ``absorb`` turns a batch of them into the records ``step_end``'s quiet path would have made.

Records are raw tuples of clocks (the step's start, its end, the previous step's end, tpudiag's own time), handed
every few seconds to a writer thread that turns them into rows and spools them: memory does not grow with the run,
and the training thread builds nothing it does not need to decide on.  (Every step is in the store, so the context
before a trigger window is the pulse table itself.)
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch  # the capture has it loaded: this module is imported when a capture starts

from tpudiag import internal_errors
from tpudiag.collectors.root_steps import RootSteps
from tpudiag.longrun import control, probes
from tpudiag.longrun.manual import POLL_S
from tpudiag.longrun.stalls import StallClock
from tpudiag.longrun.stride import Stride
from tpudiag.longrun.triggers import MEDIAN_EVERY, SlowSteps
from tpudiag.plugins import CaptureContext

FULL_EVERY = 64
WRITE_EVERY_S = 5.0
WAKE_ROWS = 20_000


_Tensor = torch.Tensor


def _shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    # Every step: no import statement here (~0.5 us a call on a cold step), torch's Tensor class from the module;
    # a tensor's ``shape`` (a ``torch.Size``, a tuple) is its key as it is.
    tensor = _Tensor
    key: list[Any] = []
    for a in args:
        if isinstance(a, tensor):
            key.append(a.shape)
        elif isinstance(a, (list, tuple)) and a and len(a) <= 8:
            key.append(tuple(v.shape for v in a if isinstance(v, tensor)))
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, tensor):
                key.append((k, v.shape))
    return tuple(key)


def _shapes_json(key: tuple[Any, ...]) -> str | None:
    return json.dumps([list(s) if s and isinstance(s[0], int) else s for s in key]) if key else None


def _unseen_by_modes(torch: Any) -> Any:
    """The gradient check's ops run below every dispatch mode: neither tpudiag's numerics mode nor a mode of the
    script's own sees them.  (The optimizer's post-hooks run in registration order, so the numerics mode was often
    still on the stack: it counted, checked and learned the check's ops as the script's; every ``FULL_EVERY`` steps
    the full check's new op signatures made it watch again.  Measured on the long-run bench loop: the capture's
    throughput 0.78x plain with the check, 0.93x without.)"""
    if torch._C._len_torch_dispatch_stack() == 0:
        return contextlib.nullcontext()
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


NOTHING: tuple[()] = ()  # what most steps fire


class PulseRecorder:
    def __init__(self, ctx: CaptureContext, rank: int = 0) -> None:
        self._ctx = ctx
        self.rank = rank
        self.step = 0  # steps ended so far (the next step's index)
        self._epoch_offset = time.time_ns() - time.perf_counter_ns()
        self.started_ns: int | None = None  # the step's first root forward; None between a step's end and the next
        self.ended = False  # a step ended and no root forward has come since (the trace collector's step boundary)
        self.roots = RootSteps()  # when root calls end steps too (collectors/root_steps.py)
        # The window plan (set by the trace collector): ``step_end`` hands it the step unless it is quiet.
        self.plan: Any = None
        self.poller: Any = None  # the manual trigger's
        self.after: Callable[[list[tuple[str, str]] | tuple[()], float], None] | None = None
        # ``time.monotonic()`` (the plan's clock) from ``perf_counter_ns`` (one clock on Linux; an offset taken once
        # elsewhere): the common step reads no clock of its own for the plan.
        self._monotonic_offset = time.monotonic() - time.perf_counter_ns() * 1e-9
        self._prev_end: int | None = None
        self._shapes: str | None = None
        self._shape_json: dict[tuple[Any, ...], str | None] = {}
        self._own = 0
        self._compiles = control.compile_counts()
        self._checker_s = control.checker_seconds()  # the numerics checker's own seconds at the last step's end
        self._background_ns = control.background_ns()  # tpudiag's background threads' work, likewise
        self._check: Any = None  # (tensor, event or None) of the last gradient check, not read yet
        self._check_step = 0  # the step it checked (read at the next full step: collectors/steady_steps.py)
        self._small: dict[int, Any] = {}  # optimizer id -> the parameter whose gradient is summed every step
        # Records as the training thread leaves them (``step_end``), and what is rare beside them, by step.
        self._batch: list[tuple[Any, ...]] = []
        self._nonfinite: dict[int, bool] = {}
        self._compiled: dict[int, tuple[int, int, int]] = {}
        self._ready: deque[tuple[list[tuple[Any, ...]], dict[int, bool], dict[int, tuple[int, int, int]]]] = deque()
        self._checks = 0  # gradient checks made (every FULL_EVERY-th reads every gradient)
        self._stride = Stride()  # the gradient check, thinned on fast steps (tpudiag.longrun.stride)
        self._check_every_ns = int(self._stride.every_s * 1e9)
        self._next_check_ns = 0  # perf_counter_ns at which the next gradient check is due (after the first steps)
        self._hand_every_ns = int(WRITE_EVERY_S * 1e9)
        self._hand_ns = 0  # perf_counter_ns at which the records go to the writer
        self._due_ns = 0  # the earliest of the two: ``_due`` runs at this clock ...
        self._due_step = 0  # ... or at this step
        factor = ctx.options.get("slow_factor") or os.environ.get("TPUDIAG_SLOW_FACTOR")
        self.slow = SlowSteps(factor=float(factor)) if factor else SlowSteps()
        self._recent_append = self.slow.recent.append
        self._slow_ns: float = math.inf  # a judged period above this may be slow (``SlowSteps.threshold_s``)
        self.stall_clock = StallClock()  # whether a slow step was the machine's (tpudiag/longrun/stalls.py)
        self.window_id: int | None = None  # set by the window planner while a window is open
        self.slow_ratio: float | None = None  # the step that just ended fired slow_step: its multiple of the median
        self.nonfinite_steps = 0
        self.rows = 0
        self.degraded: str | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="tpudiag-pulse", daemon=True)
        self._writer.start()

    # -- per step (training thread) -----------------------------------------------------------------------
    def add_own(self, ns: int) -> None:
        self._own += ns

    def step_begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        t0 = time.perf_counter_ns()
        self.started_ns = t0
        if not kwargs and len(args) == 1 and type(args[0]) is _Tensor:  # ``model(x)``: the key without a call
            key: tuple[Any, ...] = (args[0].shape,)
        else:
            key = _shape_key(args, kwargs)
        shapes = self._shape_json.get(key, "")
        if shapes == "":
            shapes = _shapes_json(key)
            if len(self._shape_json) < 4096:
                self._shape_json[key] = shapes
        self._shapes = shapes
        self._own += time.perf_counter_ns() - t0

    def step_end(self, optimizer: Any) -> list[tuple[str, str]] | tuple[()]:
        """End of a step (``step_points``' callback, the trace collector's): its record, the window plan's turn
        (``after``) unless the plan is quiet; the triggers it fired as (reason, detail).

        Written for a step whose caches the script has just filled (each object touched here is a cache miss, each
        call a cold frame): the common step reads two clocks and a few counters, compares its period with a
        precomputed threshold, and appends one tuple.  What is rare runs only when its counter or clock says so:
        a gradient check to read or to start, a compile event, the checker's or a background thread's time to take
        out, a period over the threshold, and (every ``MEDIAN_EVERY`` steps or ``WRITE_EVERY_S`` seconds, ``_due``)
        the rolling median and the hand-off of the records to the writer thread, which builds the table."""
        end = time.perf_counter_ns()
        self.ended = True
        if optimizer is not None and self.roots.by_root:  # an optimizer step: only these end steps from now on
            self.roots.by_root = False
        start, prev = self.started_ns, self._prev_end
        step = self.step
        fired: list[tuple[str, str]] | tuple[()] = NOTHING
        if self._check is not None:
            fired = self._read_previous(step)
        if control.STATE.compiles != self._compiles[0]:
            fired = self._compile_events(step, fired)
        # The numerics checker's time since the last step's end (its checks in this step, its boundary work in the
        # gap) is tpudiag's own time: counted as such, and never judged as the script's slowness.  So is what
        # tpudiag's background threads did meanwhile (the script's thread waited on their GIL).
        budget = control.checker_budget
        checker_ns = 0
        if budget is not None:
            checker = budget.extra_s + budget.per_op_overhead_s * budget.ops_seen  # ``Budget.own_s``, no call
            if checker != self._checker_s:
                checker_ns = max(int((checker - self._checker_s) * 1e9), 0)
                self._checker_s = checker
        background = control.background_ns() if control.bg_running else control.bg_done_ns
        background_ns = 0
        if background != self._background_ns:
            background_ns = background - self._background_ns
            self._background_ns = background
        # A step's period (the gap before it, where data loading waits, and the step itself) is what slows a job.
        # Steps inside a window (and the one that closes it) pay for the profiler and the checker: not a signal.
        # A step the checker watched is not judged at all: the checker's clock holds its checks, not the dispatch of
        # every op through its mode, so such a step still read 4-5x the median (every periodic re-check step on the
        # bench loop), and its outlier let the next jitter step fire as a repeat: slow_step windows of tpudiag's
        # making.  A step that compiled or fired another trigger is judged (the median learns it) but opens no
        # slow_step window: its own trigger says why it was slow.
        self.slow_ratio = None
        if self.window_id is None and not checker_ns:
            period = end - (prev if prev is not None else start if start is not None else end) - background_ns
            if period > self._slow_ns:
                fired = self._slow_step(step, period, end, fired)
            else:
                self._recent_append(period * 1e-9)
        self._batch.append(
            (step, start, end, prev, self._own + checker_ns, self._shapes, self.window_id,
             probes.collect() if probes.published or probes.pulling else None)
        )  # fmt: skip
        self.step = step + 1
        self._prev_end = end
        self.started_ns = None
        if end >= self._due_ns or step >= self._due_step:
            self._due(optimizer, step, end)
        plan = self.plan
        if plan is not None and self.after is not None:
            # The plan's turn, unless it is quiet: nothing fired, nothing asked for, the manual trigger's poll and
            # the schedule not due (``WindowPlan.plan``'s own first test, inlined: no call).
            now = end * 1e-9 + self._monotonic_offset
            quiet = plan._quiet
            if (
                quiet is None
                or fired
                or now >= self.poller.next_s
                or (step + 1 >= quiet[0] and now >= quiet[1])
                or control.STATE.pending
            ):
                self.after(fired, now)
        # tpudiag's time from here on (the plan's included) is in the next step's period: counted there.
        self._own = time.perf_counter_ns() - end
        return fired

    # -- steady steps (collectors/steady_steps.py) ------------------------------------------------------------
    def horizon(self, gate: Any) -> None:
        """After a full step end: the steps ``step_end`` would end on its quiet path (nothing to read, fire, hand
        off or plan), and until when; the slow-step threshold and the compile count the fast path compares."""
        plan, poller, prev = self.plan, self.poller, self._prev_end
        quiet = plan._quiet if plan is not None else None
        if (
            quiet is None
            or poller is None
            or prev is None
            or self.window_id is not None
            or self.roots.by_root != gate.byroot
            or (
                gate.byroot
                and (self.roots.waiting or self.started_ns is None or self.roots.step_root != gate.module_id)
            )
            or plan.close_next
            or plan.next is not None
            or plan.open is not None
            or probes.pulling
            or probes.published
            or control.STATE.pending
        ):
            gate.shut()
            return
        to_ns = 1e9
        offset = self._monotonic_offset
        # (``_due``'s step count, the rolling median's refresh, waits for the next full step; its clocks do not)
        # A manual trigger's poll due waits up to one more POLL_S for a full step that comes anyway (a reading's,
        # every ``Stride.every_s``): a request is seen within a second, and polls add no full steps of their own.
        until = min(self._due_ns, (poller.next_s + POLL_S - offset) * to_ns)
        steps = 1 << 30
        # The schedule is due once the step reaches ``quiet[0]`` and the clock ``quiet[1]``: before either, quiet.
        now_s = prev * 1e-9 + offset
        if quiet[1] > now_s:
            until = min(until, (quiet[1] - offset) * to_ns)
        elif quiet[0] - 1 - self.step < steps:
            steps = int(quiet[0] - 1 - self.step)
        gate.limit(steps, until)
        gate.slow_ns = self._slow_ns
        gate.last_end = prev
        gate.compiles = self._compiles[0]

    def absorb(self, starts: list[int], ends: list[int]) -> None:
        """Steady steps: the records and the periods ``step_end``'s quiet path would have kept (their own time,
        the few us of the fast path's checks, left out).  The checker's and the background threads' time since the
        last full step stays to be taken out of the next full step's period (none of these steps was judged slow)."""
        prev = self._prev_end
        step, own, shapes = self.step, self._own, self._shapes
        append, recent = self._batch.append, self._recent_append
        for start, end in zip(starts, ends, strict=True):
            append((step, start, end, prev, own, shapes, None, None))
            recent((end - prev) * 1e-9 if prev is not None else 0.0)
            own = 0
            prev = end
            step += 1
        self.step, self._prev_end, self._own = step, prev, 0
        self.started_ns = None
        self.ended = True

    def resume(self, start: int) -> None:
        """A steady step's root call began at ``start``: the step in progress, as ``step_begin`` leaves it (its
        inputs are the last full step's)."""
        self.started_ns = start
        self.ended = False

    # -- the rare parts of a step's end -----------------------------------------------------------------------
    def _read_previous(self, step: int) -> list[tuple[str, str]] | tuple[()]:
        """The last gradient check, read now (``_read_check``; a step late, or at the first full step after the
        steady ones that followed it): its record's non-finite figure."""
        nonfinite = self._read_check()
        if nonfinite is None:
            return NOTHING
        checked = self._check_step
        self._nonfinite[checked] = nonfinite
        if not nonfinite:
            return NOTHING
        self.nonfinite_steps += 1
        return [("nonfinite", f"a non-finite gradient at step {checked}")]

    def _compile_events(self, step: int, fired: list[tuple[str, str]] | tuple[()]) -> list[tuple[str, str]]:
        c0, r0, g0 = self._compiles
        self._compiles = compiles = control.compile_counts()
        self._compiled[step] = (compiles[0] - c0, compiles[1] - r0, compiles[2] - g0)
        out = list(fired)
        if compiles[1] > r0:
            out.append(("recompile", f"recompile at step {step}: {control.compile_detail() or ''}".rstrip(": ")))
        if compiles[2] > g0:
            out.append(("graph_break", f"graph break at step {step}: {control.compile_detail() or ''}".rstrip(": ")))
        return out

    def _slow_step(
        self, step: int, period: int, end: int, fired: list[tuple[str, str]] | tuple[()]
    ) -> list[tuple[str, str]] | tuple[()]:
        """A period over the precomputed threshold: not the script's when the machine held its thread off the CPU
        for the excess (``StallClock``: neither judged nor learnt by the median); else ``SlowSteps.fires`` decides
        (the median, the repeats)."""
        held = self.stall_clock.held_ns(end)
        if held and period - held <= self._slow_ns:
            self.stall_clock.found(held)
            return fired
        if not self.slow.fires(period / 1e9, step) or fired:
            return fired
        median = self.slow.median_s
        if not median:
            return fired
        self.slow_ratio = period / 1e9 / median
        return [
            (
                "slow_step",
                f"step {step} took {period / 1e6:.1f} ms with the gap before it, "
                f"{self.slow_ratio:.1f}x the median {median * 1e3:.2f} ms",
            )
        ]

    def _due(self, optimizer: Any, step: int, end: int) -> None:
        """Every step of the first window, then every ``MEDIAN_EVERY`` steps or when a clock is due: the gradient
        check (``tpudiag.longrun.stride``: every ``every_s``), the rolling median's threshold, the hand-off."""
        first = step < self._stride.first_steps
        if first or end >= self._next_check_ns:
            self._next_check_ns = end + self._check_every_ns
            self._check_step = step
            self._start_check(optimizer)
            self.stall_clock.mark(end)
        if step >= self._due_step:
            self._due_step = step + (1 if first else MEDIAN_EVERY)
            threshold = self.slow.refresh()
            self._slow_ns = threshold * 1e9 if threshold is not None else math.inf
        if end >= self._hand_ns or len(self._batch) >= WAKE_ROWS:
            self._hand_ns = end + self._hand_every_ns
            self._hand_off()
        self._due_ns = min(self._next_check_ns, self._hand_ns)

    def _hand_off(self, final: bool = False) -> None:
        """The records so far to the writer thread (which alone builds tables).  A record whose gradient check is
        still to be read stays for the next hand-off."""
        batch = self._batch
        keep = batch[-1:] if self._check is not None and not final else []
        nonfinite, compiled = self._nonfinite, self._compiled
        self._nonfinite, self._compiled = {}, {}
        if keep:
            batch.pop()
            last = keep[0][0]
            if last in compiled:
                self._compiled[last] = compiled.pop(last)
        if batch:
            self._ready.append((batch, nonfinite, compiled))
        self._batch = keep
        self._wake.set()

    # -- non-finite gradients, read a step late ---------------------------------------------------------------
    def _start_check(self, optimizer: Any) -> None:
        if optimizer is None:  # a step ended at a root call (collectors/root_steps.py): no gradients to check
            self._check = None
            return
        try:
            if torch._C._autograd._profiler_enabled():
                # Inside a trace window no check: the window's trace (and its exports) hold the script's ops only,
                # as a capture without the pulse would.  The window's steps read None.
                self._check = None
                return
            self._checks += 1
            if self._checks % FULL_EVERY == 0:
                with torch.no_grad(), _unseen_by_modes(torch):
                    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
                    if not grads:
                        self._check = None
                        return
                    value = torch.stack([n.float() for n in torch._foreach_norm(grads)]).sum()
            else:
                param = self._small_param(optimizer)
                grad = param.grad if param is not None else None
                if grad is None:
                    self._check = None
                    return
                if grad.requires_grad:  # a gradient with a graph of its own (create_graph): the check adds none
                    grad = grad.detach()
                with _unseen_by_modes(torch):
                    value = grad.sum(dtype=torch.float32)
            event = None
            if value.is_cuda:
                event = torch.cuda.Event()
                event.record()
            self._check = (value, event)
        except Exception as err:
            self._check = None
            internal_errors.current().record("pulse", "gradient check", err)

    def _small_param(self, optimizer: Any) -> Any:
        key = id(optimizer)
        param = self._small.get(key)
        if param is None or param.grad is None:
            params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if not params:
                return None
            param = min(params, key=lambda p: p.numel())
            self._small[key] = param
        return param

    def _read_check(self, final: bool = False) -> bool | None:
        check, self._check = self._check, None
        if check is None:
            return None
        value, event = check
        # On the CPU read now; on CUDA once its event has completed (an event is recorded for every CUDA check);
        # on other devices (TPU) only at the end.
        if final or (event.query() if event is not None else value.is_cpu):
            try:
                with _unseen_by_modes(torch):
                    return not math.isfinite(value.item())
            except Exception:
                return None
        return None

    # -- spooling (writer thread) -------------------------------------------------------------------------------
    def _write_loop(self) -> None:
        # What a write needs is imported now, at the capture's start: the first write's imports (pyarrow and the
        # schema, ~0.3 s) held the GIL mid-run, and the script's steps waited (45 ms steps on the bench loop).
        # Counted as background work too: the script's first steps wait on its GIL, and are not slow for that.
        with control.background_work(), contextlib.suppress(Exception):
            import pyarrow.parquet  # noqa: F401  (the spool's writer)

            self._table([])
        while not self._stopping:
            self._wake.wait(WRITE_EVERY_S)
            self._wake.clear()
            with control.background_work():  # its GIL is not the script's slowness (``step_end``)
                self.write()

    def write(self) -> None:
        with self._lock:
            ready = self._ready
            while ready:
                batch, nonfinite, compiled = ready.popleft()
                if self.degraded:
                    continue
                try:
                    self._ctx.spool.write_table("pulse", self._table(batch, nonfinite, compiled))
                    self.rows += len(batch)
                except Exception as err:
                    self.degraded = str(err)
                    self._ctx.note(f"pulse: could not be written ({err}); the script went on, the pulse stopped there")

    def _table(
        self,
        batch: list[tuple[Any, ...]],
        nonfinite: dict[int, bool] | None = None,
        compiled: dict[int, tuple[int, int, int]] | None = None,
    ) -> Any:
        """The pulse table of a hand-off: each record's clocks turned into its start, duration, gap and own time
        (never more than the step's period: tpudiag's time is spent inside it), its rare figures joined by step.

        Built by column (``zip`` transposes the records, numpy does the arithmetic): a row at a time in Python cost
        ~3 us a record on the writer thread, whose GIL the script's steps wait on (~0.25% of the long-run bench's
        fast loop)."""
        import numpy as np

        from tpudiag import arrow_columns
        from tpudiag.model import PulseStep, arrow_schema

        schema = arrow_schema(PulseStep)
        n = len(batch)
        if not n:  # (not ``schema.empty_table()``: it imports pandas, if installed)
            return arrow_columns.table({field.name: [] for field in schema}, schema)
        steps, starts, ends, prevs, owns, shapes, window_ids, figures = (list(c) for c in zip(*batch, strict=True))
        # A record without a start (no root call seen) starts at the previous step's end and has no gap; the first
        # record of the run has no previous end (no gap either).
        gap_valid: Any = None
        if None in starts or None in prevs:
            gap_valid = np.ones(n, dtype=bool)
            for i in range(n):
                if starts[i] is None:
                    starts[i] = prevs[i] if prevs[i] is not None else ends[i]
                    gap_valid[i] = False
                elif prevs[i] is None:
                    gap_valid[i] = False
                if prevs[i] is None:
                    prevs[i] = starts[i]
        start = np.array(starts, dtype=np.int64)
        dur = np.array(ends, dtype=np.int64) - start
        gap = start - np.array(prevs, dtype=np.int64)  # 0 where not valid
        own = np.minimum(np.array(owns, dtype=np.int64), dur + gap)
        counts = np.zeros((3, n), dtype=np.int64)
        nonfinite_values: list[bool | None] = [None] * n
        if compiled or nonfinite:
            where = {step: i for i, step in enumerate(steps)}
            for step, (c, r, g) in (compiled or {}).items():
                at = where.get(step)
                if at is not None:
                    counts[0, at], counts[1, at], counts[2, at] = c, r, g
            for step, value in (nonfinite or {}).items():
                at = where.get(step)
                if at is not None:
                    nonfinite_values[at] = value
        int64 = arrow_columns.int64_array
        columns: dict[str, Any] = {
            "run_id": [self._ctx.run_id] * n,
            "step": int64(np.array(steps, dtype=np.int64)),
            "start_ns": int64(start + self._epoch_offset),
            "dur_ns": int64(dur),
            "gap_ns": int64(gap, gap_valid),
            "own_ns": int64(own),
            "rank": int64(np.full(n, self.rank, dtype=np.int64)),
            "shapes": shapes,
            "compiles": int64(counts[0]),
            "recompiles": int64(counts[1]),
            "graph_breaks": int64(counts[2]),
            "nonfinite": nonfinite_values,
            "window_id": window_ids,
            "figures": [json.dumps(f) if f else None for f in figures],
        }
        return arrow_columns.table(columns, schema)

    def stop(self) -> None:
        """The last step's gradient check (read now: the script has ended) and the last records."""
        if self._check is not None and self.step:
            nonfinite = self._read_check(final=True)
            if nonfinite is not None:
                self._nonfinite[self._check_step] = nonfinite
                if nonfinite:
                    self.nonfinite_steps += 1
        self._hand_off(final=True)
        self.stall_clock.close()
        self._stopping = True
        self._wake.set()
        with contextlib.suppress(Exception):
            self._writer.join(timeout=10)
        self.write()
