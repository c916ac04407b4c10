"""The pulse: one small record for every step of the run, always on (issue 21).

Per step: wall time (first root-module forward to the end of the optimizer step), the gap since the previous step
(data wait and whatever runs between steps), tpudiag's own time in its hooks, the root module's input shapes, compile
events, whether a gradient was non-finite, and the figures of registered per-step probes (``tpudiag.longrun.probes``:
memory, plugins).

Cost: two ``perf_counter_ns`` calls, a small list, a rolling median updated every 16 steps, and at most every
50 ms one small device op (``tpudiag.longrun.stride``: every step of the first window's steps and of steps of 50 ms
or more).  Non-finiteness is read without a sync (and not inside trace windows, whose traces hold the script's ops
only): a checked step sums the gradient of its smallest parameter on the device (every ``FULL_EVERY`` checks: the
norms of all gradients), below every dispatch mode, and the result is read at the *next* step's end, when it is
long done: on the CPU reading is free, on CUDA only once its event has completed, on other devices (TPU) never
during the run (the figure reads None: an ``.item()`` would change the program).  A NaN in any gradient reaches
every parameter through the update, so the one small gradient sees it at the next check; the periodic full check
covers the rest.

Records are kept in a ring (the context a trigger window reports) and handed in batches to a writer thread that
spools them every few seconds: memory does not grow with the run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections import deque
from typing import Any

import torch  # the capture has it loaded: this module is imported when a capture starts

from tpudiag import internal_errors
from tpudiag.longrun import control, probes
from tpudiag.longrun.stride import Stride
from tpudiag.longrun.triggers import SlowSteps
from tpudiag.plugins import CaptureContext

FULL_EVERY = 64
RING = 256
WRITE_EVERY_S = 5.0
WAKE_ROWS = 20_000
COLUMNS = (
    "step",
    "start_ns",
    "dur_ns",
    "gap_ns",
    "own_ns",
    "shapes",
    "compiles",
    "recompiles",
    "graph_breaks",
    "nonfinite",
    "window_id",
    "figures",
)


def _shape_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    # Every step: no import statement here (~0.5 us a call on a cold step), torch's Tensor class from the module.
    tensor = torch.Tensor
    key: list[Any] = []
    for a in args:
        if isinstance(a, tensor):
            key.append(tuple(a.shape))
        elif isinstance(a, (list, tuple)) and a and len(a) <= 8:
            key.append(tuple(tuple(v.shape) for v in a if isinstance(v, tensor)))
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, tensor):
                key.append((k, tuple(v.shape)))
    return tuple(key)


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


class PulseRecorder:
    def __init__(self, ctx: CaptureContext, rank: int = 0) -> None:
        self._ctx = ctx
        self.rank = rank
        self.step = 0  # steps ended so far (the next step's index)
        self._epoch_offset = time.time_ns() - time.perf_counter_ns()
        self._start: int | None = None
        self._prev_end: int | None = None
        self._shapes: str | None = None
        self._shape_json: dict[tuple[Any, ...], str | None] = {}
        self._own = 0
        self._compiles = control.compile_counts()
        self._checker_s = control.checker_seconds()  # the numerics checker's own seconds at the last step's end
        self._background_ns = control.background_ns()  # tpudiag's background threads' work, likewise
        self._pending: list[Any] | None = None  # the last step's record, waiting for its non-finite figure
        self._check: Any = None  # (tensor, event or None) of the last step's gradient check
        self._small: dict[int, Any] = {}  # optimizer id -> the parameter whose gradient is summed every step
        self.ring: deque[list[Any]] = deque(maxlen=RING)
        self._batch: list[list[Any]] = []
        self._checks = 0  # gradient checks made (every FULL_EVERY-th reads every gradient)
        self._stride = Stride()  # the gradient check, thinned on fast steps (tpudiag.longrun.stride)
        self._check_every_ns = int(self._stride.every_s * 1e9)
        self._next_check_ns = 0  # perf_counter_ns at which the next gradient check is due (after the first steps)
        factor = ctx.options.get("slow_factor") or os.environ.get("TPUDIAG_SLOW_FACTOR")
        self.slow = SlowSteps(factor=float(factor)) if factor else SlowSteps()
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
    def now_ns(self) -> int:
        return time.perf_counter_ns()

    def add_own(self, ns: int) -> None:
        self._own += ns

    def step_begin(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        t0 = time.perf_counter_ns()
        self._start = t0
        key = _shape_key(args, kwargs)
        shapes = self._shape_json.get(key, "")
        if shapes == "":
            shapes = json.dumps([list(s) if s and isinstance(s[0], int) else s for s in key]) if key else None
            if len(self._shape_json) < 4096:
                self._shape_json[key] = shapes
        self._shapes = shapes
        self._own += time.perf_counter_ns() - t0

    def step_end(self, optimizer: Any) -> tuple[float, list[tuple[str, str]]]:
        """End of a step (the optimizer's post-hook): its record; its duration in seconds and the triggers it fired
        as (reason, detail).

        Written for a step whose caches the script has just filled (each object touched here is a cache miss, each
        call a cold frame): the common step reads a few attributes and two counters, judges the step against the
        median and appends its record; the rarer parts (a gradient check due, a compile event, the checker's or a
        background thread's time to take out) run only when their counter or clock says so."""
        end = time.perf_counter_ns()
        start, prev_end = self._start, self._prev_end
        if start is None:
            start, gap = (prev_end if prev_end is not None else end), None
        else:
            gap = start - prev_end if prev_end is not None else None
        dur = end - start
        step = self.step
        fired: list[tuple[str, str]] = []
        pending = self._pending
        if pending is not None:
            nonfinite_prev = self._read_check() if self._check is not None else None
            pending[9] = nonfinite_prev
            self.ring.append(pending)
            batch = self._batch
            batch.append(pending)
            if len(batch) >= WAKE_ROWS:
                self._wake.set()
            if nonfinite_prev:
                self.nonfinite_steps += 1
                fired.append(("nonfinite", f"a non-finite gradient at step {pending[0]}"))
        if end >= self._next_check_ns or step < self._stride.first_steps:  # ``Stride.due``, inlined
            self._next_check_ns = end + self._check_every_ns
            self._start_check(optimizer)
        c0, r0, g0 = compiles = self._compiles
        if control.STATE.compiles != c0:
            self._compiles = compiles = control.compile_counts()
            if compiles[1] > r0:
                fired.append(("recompile", f"recompile at step {step}: {control.compile_detail() or ''}".rstrip(": ")))
            if compiles[2] > g0:
                detail = f"graph break at step {step}: {control.compile_detail() or ''}".rstrip(": ")
                fired.append(("graph_break", detail))
        # The numerics checker's time since the last step's end (its checks in this step, its boundary work in the
        # gap) is tpudiag's own time: counted as such, and never judged as the script's slowness.  So is what
        # tpudiag's background threads did meanwhile (the script's thread waited on their GIL).
        # (Both read without a call on most steps: ``control.checker_seconds`` and ``control.background_ns``.)
        clock = control.checker_clock
        checker = clock() if clock is not None else 0.0
        checker_ns = 0
        if checker != self._checker_s:
            checker_ns = max(int((checker - self._checker_s) * 1e9), 0)
            self._checker_s = checker
        background = control.background_ns() if control.bg_running else control.bg_done_ns
        background_ns = background - self._background_ns
        if background_ns:
            self._background_ns = background
        # A step's period (the gap before it, where data loading waits, and the step itself) is what slows a job.
        # Steps inside a window (and the one that closes it) pay for the profiler and the checker: not a signal.
        period = max(dur + (gap or 0) - checker_ns - background_ns, 0)
        # A step that compiled is slow for that reason: its recompile or graph break window says so.  A step the
        # checker watched is not judged at all: the checker's clock holds its checks, not the dispatch of every op
        # through its mode, so such a step still read 4-5x the median (every periodic re-check step on the bench
        # loop), and its outlier let the next jitter step fire as a repeat: slow_step windows of tpudiag's making.
        self.slow_ratio = None
        if self.window_id is None and checker_ns == 0 and self.slow.fires(period / 1e9) and not fired:
            median = self.slow.median_s
            if median:
                self.slow_ratio = period / 1e9 / median
                fired.append(
                    (
                        "slow_step",
                        f"step {step} took {period / 1e6:.1f} ms with the gap before it, "
                        f"{self.slow_ratio:.1f}x the median {median * 1e3:.2f} ms",
                    )
                )
        # The figures dict as it is: serialised by the writer thread, off the step.
        record = [step, start + self._epoch_offset, dur, gap, 0, self._shapes, compiles[0] - c0, compiles[1] - r0,
                  compiles[2] - g0, None, self.window_id,
                  probes.collect() if probes.published or probes.pulling else None]  # fmt: skip
        self._pending = record
        self.step = step + 1
        self._prev_end = end
        self._start = None
        # Never more than the step's period: tpudiag's time is spent inside it.
        record[4] = min(self._own + checker_ns + (time.perf_counter_ns() - end), dur + (gap or 0))
        self._own = 0
        return dur / 1e9, fired

    def _keep(self, record: list[Any]) -> None:
        self.ring.append(record)
        self._batch.append(record)
        if len(self._batch) >= WAKE_ROWS:
            self._wake.set()

    # -- non-finite gradients, read a step late ---------------------------------------------------------------
    def _start_check(self, optimizer: Any) -> None:
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
            batch, self._batch = self._batch, []
            if not batch or self.degraded:
                return
            try:
                self._ctx.spool.write_table("pulse", self._table(batch))
                self.rows += len(batch)
            except Exception as err:
                self.degraded = str(err)
                self._ctx.note(f"pulse: could not be written ({err}); the script went on, the pulse stopped there")

    def _table(self, batch: list[list[Any]]) -> Any:
        import pyarrow as pa

        from tpudiag.model import PulseStep, arrow_schema

        # Transposed in C (``zip``): the writer holds the GIL as briefly as it can, the script's steps wait on it.
        columns = list(zip(*batch, strict=True)) if batch else [()] * len(COLUMNS)
        cols: dict[str, Any] = dict(zip(COLUMNS, columns, strict=True))
        cols["figures"] = [json.dumps(f) if f else None for f in cols["figures"]]
        cols["run_id"] = [self._ctx.run_id] * len(batch)
        cols["rank"] = [self.rank] * len(batch)
        schema = arrow_schema(PulseStep)
        return pa.table({f.name: cols[f.name] for f in schema}, schema=schema)

    def stop(self) -> None:
        """The last step's record (its gradient check read now: the script has ended) and the last batch."""
        if self._pending is not None:
            nonfinite = self._read_check(final=True)
            self._pending[9] = nonfinite
            self._keep(self._pending)
            if nonfinite:
                self.nonfinite_steps += 1
            self._pending = None
        self._stopping = True
        self._wake.set()
        with contextlib.suppress(Exception):
            self._writer.join(timeout=10)
        self.write()
