"""The ``numerics`` collector: the dispatch mode on the script's watched steps, rows spooled as it goes.

Here: the plugin protocol (start builds the mode and its context; stop is the teardown: checking off, the mode
left, the progress thread, hooks and compile callback removed, the last rows written), the announcement of the
first divergence, the live progress line on stderr and torch.compile bookkeeping.

Elsewhere: step boundaries, attach and detach (``steps``), the summary once stopped (``summary``), module paths
for backward ops (``backward_modules``), the device, its reduced-precision matmul units and the per-op cost of a
dispatch mode (``device``).
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from typing import Any

from tpudiag import console
from tpudiag.collectors.numerics import device
from tpudiag.collectors.numerics.backward_modules import BackwardModules
from tpudiag.collectors.numerics.steps import ModuleBoundaries, StepBoundaries, StepState, on_top
from tpudiag.collectors.numerics.summary import RunSummary, counts_line
from tpudiag.longrun import control
from tpudiag.plugins import CaptureContext

PROGRESS_INTERVAL_TTY_S = 0.5
PROGRESS_INTERVAL_PIPE_S = 30.0


class NumericsCollector(StepBoundaries, RunSummary):
    name = "numerics"
    description = (
        "every aten op re-run on a CPU float64 oracle from its own inputs: verdict and error of each output, "
        "the op that started a divergence (originator), coverage and skip reasons"
    )
    start_order = 30  # last: its dispatch mode is innermost and leaves first

    def __init__(self) -> None:
        self._ctx: CaptureContext | None = None
        self._mode: Any = None
        self._recorder: Any = None
        self._tracker: Any = None
        self._backward: BackwardModules | None = None
        self._compiles = 0
        self._compile_cb: Any = None
        self._progress_stop = threading.Event()
        self._progress: threading.Thread | None = None
        self._entered = False
        self._settings: dict[str, Any] = {}
        self._module_hook_on = False  # _on_module sees module calls (step boundaries, budget detach)
        self._boundaries = ModuleBoundaries(self)
        self._step_hook: Any = None
        self._hooks_on = False
        self._root: Any = None
        self._opt_steps = 0
        self._steps = StepState()
        self._probes: set[int] = set()  # ids of root modules whose inputs are probed on every step
        self._root_inputs: set[tuple[Any, ...]] = set()

    # -- plugin protocol --------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("torch") is not None

    def prepare(self, ctx: CaptureContext) -> None:
        from tpudiag.collectors.numerics.sampling import parse_options

        parse_options(ctx.options)  # bad options fail before the script runs

    def start(self, ctx: CaptureContext) -> None:
        from tpudiag import environment
        from tpudiag.collectors.modules import ModuleTracker
        from tpudiag.collectors.numerics.mode import Context, NumericsMode
        from tpudiag.collectors.numerics.records import Recorder
        from tpudiag.collectors.numerics.sampling import Budget, parse_options

        self._ctx = ctx
        options = parse_options(ctx.options)
        device_kind = device.device_kind()
        precision = environment.precision()
        self._tracker = ModuleTracker()
        self._backward = BackwardModules(self._tracker)
        tracker, backward = self._tracker, self._backward

        def module_of(phase: str) -> str | None:
            return backward.current() if phase == "backward" else tracker.current()

        self._recorder = Recorder(ctx.run_id, ctx.run_dir / "numerics" / "repro")
        budget = Budget(options.budget_pct)
        if options.budget_pct is not None:
            budget.per_op_overhead_s = device.calibrate_overhead()
        mctx = Context(
            run_id=ctx.run_id,
            device_kind=device_kind,
            emulations=device.emulations_for(device_kind, precision),
            precision_json=json.dumps(precision, sort_keys=True),
            module_of=module_of,
            on_divergence=self._announce,
        )
        self._mode = NumericsMode(mctx, options, self._recorder, budget)
        from tpudiag.collectors.numerics.compiled import session as compiled_session  # issue 12

        self._compiled = compiled_session.start(ctx, options, self._mode, self._recorder, device_kind)
        self._settings = {
            "sampling": {
                "mode": options.mode,
                "first_k": options.first_k,
                "ops": list(options.ops),
                "modules": list(options.modules),
                "budget_pct": options.budget_pct,
            },
            "precision": {"device_kind": device_kind, "emulated_matmul_units": list(mctx.emulations)},
        }
        self._register_compile_callback()
        if options.enabled:
            from tpudiag.collectors.numerics.sampling import StepSchedule

            self._steps.schedule = StepSchedule(watch_all=options.mode == "all")
            from tpudiag.collectors import module_calls

            # Added before the module tracker: the tracker's stack is still empty when a root's call begins.
            module_calls.add(self._boundaries)
            from tpudiag.collectors import step_points

            # After the trace collector's window plan: a trigger window's first step is watched already.
            from tpudiag.collectors.numerics.steps import SteadyNumerics

            self._step_hook = step_points.add(
                self._step_end, step_points.FOLLOW, "numerics", main_thread_only=False, steady=SteadyNumerics(self)
            )
            self._steps.t0 = time.perf_counter()
            self._steps.spent0 = self._mode.budget.spent()
            control.set_checker_budget(self._mode.budget)
            self._attach()
            self._progress = threading.Thread(target=self._progress_loop, name="tpudiag-numerics", daemon=True)
            self._progress.start()

    def flush(self) -> None:
        if self._ctx is None or self._recorder is None:
            return
        self._write(final=False)

    def stop(self) -> None:
        if self._ctx is None:
            return
        mode: Any = self._mode
        control.set_checker_budget(None)
        if mode is not None:
            mode.active = False  # whatever happens below, nothing more is checked
        if self._entered:
            if on_top(mode):
                mode.__exit__(None, None, None)
            else:
                self._ctx.note("numerics: the script left a dispatch mode of its own active above tpudiag's")
            self._entered = False
        self._progress_stop.set()
        if self._progress is not None:
            self._progress.join(timeout=5)
        self._clear_progress(erase=True)
        from tpudiag.collectors import module_calls

        parts: list[Any] = [self._tracker, self._backward, self._step_hook]
        for part in parts:
            with contextlib.suppress(Exception):
                part.remove()
        module_calls.remove(self._boundaries)
        self._unregister_compile_callback()
        self._replay_pending()
        for (op, phase), n in mode.spent_calls.items():
            self._recorder.aggregate(mode.seq, op, phase, None, "budget", 0.0, None, n)
        mode.spent_calls = {}
        from tpudiag.collectors.numerics.compiled import session as compiled_session  # issue 12

        self._settings["compiled"] = compiled_session.stop(getattr(self, "_compiled", None))
        self._write(final=True)
        self._summarize()

    def _write(self, final: bool) -> None:
        from tpudiag.model import OpDiff, OpRecord

        assert self._ctx is not None
        ops, diffs = self._recorder.drain(final)
        self._ctx.spool.write_records(OpRecord, ops)
        self._ctx.spool.write_records(OpDiff, diffs)

    def _announce(self, record: Any, diff: Any) -> None:
        # After warm-up a divergence opens a trace window (rate-limited by the trace collector's plan).
        where = record.module or "no module"
        control.request("numerics", detail=f"{record.op} seq {record.seq} ({where}): {diff.verdict}")
        if self._recorder.findings.originators == 1:
            self._clear_progress()
            sys.stderr.write(
                f"{console.prefix()}: numerics: first divergence: {record.op} seq {record.seq} "
                f"({record.module or 'no module'}, {record.phase}, {record.source_loc or '?'}): {diff.verdict}\n"
            )
            sys.stderr.flush()

    def _progress_loop(self) -> None:
        from tpudiag.progress import StatusLine

        self._status = status = StatusLine(interval_s=0.0)
        interval = PROGRESS_INTERVAL_TTY_S if status.tty else PROGRESS_INTERVAL_PIPE_S
        while not self._progress_stop.wait(interval):
            f = self._recorder.findings
            with contextlib.suppress(Exception):
                status(counts_line(f))

    def _clear_progress(self, erase: bool = False) -> None:
        """End the live line before other text; ``erase`` takes it off the terminal (the closing line follows)."""
        status = getattr(self, "_status", None)
        if status is not None:
            with contextlib.suppress(Exception):
                status.erase() if erase else status.done()

    def _register_compile_callback(self) -> None:
        with contextlib.suppress(Exception):
            from tpudiag.collectors import compile_callbacks  # kept across the script's ``torch._dynamo.reset()``

            def on_start(*_args: Any, **_kwargs: Any) -> None:
                self._compiles += 1

            compile_callbacks.register(on_start)
            self._compile_cb = on_start

    def _unregister_compile_callback(self) -> None:
        if self._compile_cb is None:
            return
        with contextlib.suppress(Exception):
            from tpudiag.collectors import compile_callbacks

            compile_callbacks.remove(self._compile_cb)
