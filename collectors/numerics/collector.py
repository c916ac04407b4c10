"""The ``numerics`` collector: the dispatch mode on the script's watched steps, rows spooled as it goes.

Step boundaries (optimizer steps, else root-module forwards) attach and detach the mode and its module hooks as
``sampling.StepSchedule`` and ``--budget`` decide; a step the mode does not watch costs nothing.

Also here: module paths for forward *and* backward ops (forward hooks tag the autograd nodes a module created, so
a backward op knows the module whose forward made its node), the precision context of the run (TF32, float32
matmul precision, TorchTPU precision and eager mode, autocast), torch.compile bookkeeping, and the live progress
line on stderr.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from typing import Any

from tpudiag import console
from tpudiag.plugins import CaptureContext

PROGRESS_INTERVAL_TTY_S = 0.5
PROGRESS_INTERVAL_PIPE_S = 30.0
_NODE_KEY = "tpudiag_module"


def emulations_for(device_kind: str, precision: dict[str, Any]) -> tuple[str, ...]:
    """Reduced-precision matmul units that could have run the run's fp32 matmuls (emulated on a finding)."""
    matmul_precision = str(precision.get("float32_matmul_precision", "highest"))
    if device_kind == "tpu":
        tpu = str(precision.get("tpu_precision", "")).upper()
        return () if "HIGHEST" in tpu else ("bf16",)
    if device_kind == "cuda":
        out: list[str] = []
        if precision.get("cuda_matmul_allow_tf32") or precision.get("cudnn_allow_tf32") or (matmul_precision == "high"):
            out.append("tf32")
        if matmul_precision == "medium":
            out.append("bf16")
        return tuple(out)
    return ("bf16",) if matmul_precision == "medium" else ()


def _device_kind() -> str:
    """The accelerator the script can use, read without initialising a runtime that is not there."""
    import torch

    if "torch_tpu" in sys.modules:
        with contextlib.suppress(Exception):
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            if acc is not None and acc.type == "tpu":
                return "tpu"
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


class _BackwardModules:
    """Module path per autograd node: after each module forward, untagged nodes behind its outputs get its path.

    A ``module_calls`` listener: exits run innermost first, so a node gets the innermost module whose forward
    created it.
    """

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker

    def install(self) -> None:
        from tpudiag.collectors import module_calls

        module_calls.add(self)

    def remove(self) -> None:
        from tpudiag.collectors import module_calls

        module_calls.remove(self)

    def enter(self, module: Any, args: Any, kwargs: Any) -> None:
        return None

    def exit(self, module: Any, token: Any, output: Any, failed: bool) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        if failed or not torch.is_grad_enabled():
            return
        path = self._tracker.path_of(module)
        leaves, _ = tree_flatten(output)
        todo = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while todo:
            node: Any = todo.pop()
            if node is None or _NODE_KEY in node.metadata:
                continue
            node.metadata[_NODE_KEY] = path
            todo.extend(n for n, _ in node.next_functions if n is not None)

    @staticmethod
    def current() -> str | None:
        import torch

        node = torch._C._current_autograd_node()
        if node is None:
            return None
        with contextlib.suppress(Exception):
            value = node.metadata.get(_NODE_KEY)  # type: ignore[attr-defined]
            return str(value) if value is not None else None
        return None


class NumericsCollector:
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
        self._backward: _BackwardModules | None = None
        self._compiles = 0
        self._compile_cb: Any = None
        self._progress_stop = threading.Event()
        self._progress: threading.Thread | None = None
        self._entered = False
        self._settings: dict[str, Any] = {}
        self._module_hook_on = False  # _on_module sees module calls (step boundaries, budget detach)
        self._boundaries = _ModuleBoundaries(self)
        self._step_hook: Any = None
        self._hooks_on = False
        self._root: Any = None
        self._opt_steps = 0
        self._steps = _StepState()
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
        device_kind = _device_kind()
        precision = environment.precision()
        self._tracker = ModuleTracker()
        self._backward = _BackwardModules(self._tracker)
        tracker, backward = self._tracker, self._backward

        def module_of(phase: str) -> str | None:
            return backward.current() if phase == "backward" else tracker.current()

        self._recorder = Recorder(ctx.run_id, ctx.run_dir / "numerics" / "repro")
        budget = Budget(options.budget_pct)
        if options.budget_pct is not None:
            budget.per_op_overhead_s = _calibrate_overhead()
        mctx = Context(
            run_id=ctx.run_id,
            device_kind=device_kind,
            emulations=emulations_for(device_kind, precision),
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
            from torch.optim.optimizer import register_optimizer_step_post_hook

            from tpudiag.collectors.numerics.sampling import StepSchedule

            self._steps.schedule = StepSchedule(watch_all=options.mode == "all")
            from tpudiag.collectors import module_calls

            # Added before the module tracker: the tracker's stack is still empty when a root's call begins.
            module_calls.add(self._boundaries)
            self._step_hook = register_optimizer_step_post_hook(module_calls.skip_in_dynamo(self._on_optimizer_step))
            self._steps.t0 = time.perf_counter()
            self._steps.spent0 = self._mode.budget.spent()
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
        if mode is not None:
            mode.active = False  # whatever happens below, nothing more is checked
        if self._entered:
            if _on_top(mode):
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
        for (op, phase), n in mode.spent_calls.items():
            self._recorder.aggregate(mode.seq, op, phase, None, "budget", 0.0, None, n)
        mode.spent_calls = {}
        from tpudiag.collectors.numerics.compiled import session as compiled_session  # issue 12

        self._settings["compiled"] = compiled_session.stop(getattr(self, "_compiled", None))
        self._write(final=True)
        f = self._recorder.findings
        self._settings.update(
            {
                "compiled_frames": self._compiles,
                "seconds_checking": round(self._mode.budget.extra_s, 3),
                "shadow_dropped": self._mode.shadow.dropped,
                # Kept float64 copies found changed without a version bump (fused/foreach/compiled writes): each
                # would have fed the oracle an old value; they were refused and copied afresh.
                "copies_stale": self._mode.copies.stale,
            }
        )
        self._settings["precision"]["autocast_seen"] = sorted(self._mode.autocast_seen)
        st = self._steps
        self._settings["steps"] = {
            "boundaries": "optimizer" if self._opt_steps else ("root_forward" if self._root is not None else None),
            "total": st.step,
            "watched": st.watched,
            "unwatched": dict(st.unwatched),
            "budget_detaches": st.budget_detaches,
            "rewatched_for_new_inputs": st.rewatches,
        }
        budget: Any = self._mode.budget
        if budget.pct is not None:
            self._settings["budget"] = {
                "pct": budget.pct,
                "spent_s": round(budget.spent(), 4),
                "entry_cost_per_op_us": round(budget.per_op_overhead_s * 1e6, 2),
                "measured_correction_s": round(budget.correction_s, 4),
                "elapsed_s": round(time.perf_counter() - self._mode.started, 4),
            }
        path = self._ctx.run_dir / "numerics" / "settings.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self._settings, indent=1))
        if st.unwatched:
            parts_s = ", ".join(f"{n} for {reason}" for reason, n in sorted(st.unwatched.items()))
            self._ctx.note(
                f"numerics: {sum(st.unwatched.values())} of {st.step} steps ran without the checker ({parts_s}); "
                "their op calls are counted as skipped from the last watched step, not seen one by one"
            )
        if st.budget_detaches:
            self._ctx.note(
                f"numerics: --budget {self._mode.budget.pct:g}% ran out {st.budget_detaches} time(s) inside a step; "
                "the checker left at the next module boundary (ops after that in the step are counted as 'budget')"
            )
        compiled = self._settings.get("compiled") or {}
        if self._compiles and compiled.get("graphs"):
            self._ctx.note(
                f"numerics: {self._compiles} torch.compile frame(s); {compiled.get('graphs_checked', 0)} of "
                f"{compiled['graphs']} compiled graph(s) checked as whole regions against a float64 replay"
            )
        elif self._compiles:
            self._ctx.note(
                f"numerics: {self._compiles} torch.compile frame(s) compiled normally; their fused kernels are "
                "not checked (aten ops they call are)"
            )
        if f.seen == 0:
            self._ctx.note("numerics: no aten ops were seen (did the script run any torch ops?)")
        elif f.checked == 0:
            self._ctx.note(f"numerics: WARNING: {f.seen} ops seen but none checked (see the report's coverage)")
        # The one closing line (the live status line, same words, was erased when checking stopped).
        closing = _counts_line(f) + (f", first divergence {f.first}" if f.first else "")
        sys.stderr.write(f"{console.prefix()}: {closing}\n")
        sys.stderr.flush()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _attach(self) -> None:
        """Module hooks on, mode pushed (only at a step boundary: no forward is running)."""
        assert self._tracker is not None and self._backward is not None
        self._module_hook_on = True
        if not self._hooks_on:
            self._tracker.install()
            self._backward.install()
            self._hooks_on = True
        if not self._entered:
            self._mode.detach_requested = False
            self._mode.__enter__()
            self._entered = True

    def _leave_mode(self) -> bool:
        if self._entered and _on_top(self._mode):
            self._mode.__exit__(None, None, None)
            self._entered = False
        return not self._entered

    def _detach(self) -> None:
        """Mode popped and module hooks off: the script runs as without tpudiag until the next attach."""
        if self._leave_mode() and self._hooks_on:
            assert self._tracker is not None and self._backward is not None
            self._tracker.remove()
            self._backward.remove()
            self._hooks_on = False
            if self._opt_steps:
                # Optimizer steps are the boundaries: unwatched steps need nothing from module calls.
                self._module_hook_on = False

    def _on_module(self, module: Any, args: Any) -> None:
        """Root forwards are step boundaries for scripts without an optimizer; budget detach mid-step."""
        tracker = self._tracker
        if self._entered and tracker is not None and id(module) not in self._probes and tracker.current() is None:
            self._add_probe(module)
        if self._opt_steps == 0 and self._tracker is not None:
            if self._root is None:
                if self._entered and self._tracker.current() is None:
                    self._root = module
                    return
            elif module is self._root:
                self._boundary()
                return
        mode: Any = self._mode
        # The first step is watched to its end (checks stop, the mode only counts) so that the calls of the steps
        # not watched later can be counted from it: a one-step pass-through cost, charged to the budget.
        if self._steps.profile is None:
            return
        if self._entered and mode is not None and mode.detach_requested and self._leave_mode():
            self._steps.partial = True
            self._steps.budget_detaches += 1

    def _add_probe(self, root: Any) -> None:
        """This root module's inputs are probed on every step, watched or not: new shapes or dtypes ask for the
        next step to be watched."""
        self._probes.add(id(root))

    def _probe(self, module: Any, args: Any, kwargs: Any) -> None:
        signature = _input_signature(args, kwargs)
        if signature in self._root_inputs:
            return
        self._root_inputs.add(signature)
        st = self._steps
        if not st.watching and len(self._root_inputs) > 1:
            st.rewatch = True
            st.rewatches += 1

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        import torch

        if torch.compiler.is_compiling():
            # Dynamo is tracing a compiled optimizer step: it must see nothing but this early return (the global
            # hook stays registered for the whole capture, so its guard on the hook dict never changes).
            return
        from tpudiag import internal_errors

        with internal_errors.current().guard("numerics", "optimizer step hook"):
            self._opt_steps += 1
            self._boundary()

    def _boundary(self) -> None:
        """End of a step: learn from it, replay its ops if it was not watched, decide whether to watch the next."""
        import torch

        mode: Any = self._mode
        if mode is None or not mode.active or torch.compiler.is_compiling():
            return
        st = self._steps
        now = time.perf_counter()
        took = now - st.t0
        budget = mode.budget
        spent_in_step = budget.spent() - st.spent0
        if st.watching:
            signatures = len(mode.sampler.counts)
            if not st.partial:
                st.schedule.step_done(signatures - st.signatures0)
                st.profile = mode.step_calls
            elif st.profile is None:
                st.profile = mode.step_calls
            checks_in_step = budget.check_s - st.check0
            if st.plain_s is not None and budget.pct is not None:
                measured = max(took - st.plain_s, 0.0)
                budget.correction_s += max(measured - spent_in_step, 0.0)
                cost = max(measured, spent_in_step)
            else:
                cost = spent_in_step
                if st.step > 0:
                    # The first step's wall time holds the script's own warm-up (lazy initialisation, optimizer
                    # state, allocator growth): compared with a warm plain step it would be charged to the checker.
                    # Its cost is what the mode measured, plus the calibrated entry cost per op.
                    st.unmeasured.append((took, spent_in_step))
            # What watching costs by itself (dispatch, hooks), plus one typical check: checks are then admitted one
            # by one inside the step as the allowance permits.
            st.watch_cost_s = max(cost - checks_in_step, 0.0) + budget.typical_check_s()
            if st.partial:
                self._replay("budget", seen=mode.step_calls)
            st.watched += 1
        else:
            st.plain_s = took if st.plain_s is None else min(st.plain_s, took)
            # Watched steps (after the first) from before any plain step was timed: charge what they really cost.
            for took_w, spent_w in st.unmeasured:
                budget.correction_s += max(took_w - st.plain_s - spent_w, 0.0)
            st.unmeasured.clear()
            self._replay(st.reason)
            st.unwatched[st.reason] = st.unwatched.get(st.reason, 0) + 1
        for (op, phase), n in mode.spent_calls.items():
            flops = st.profile.get((op, phase), [1, 0.0]) if st.profile else [1, 0.0]
            self._recorder.aggregate(mode.seq, op, phase, None, "budget", flops[1] * n / max(flops[0], 1), None, n)
        mode.spent_calls = {}
        mode.step_calls = {}
        st.step += 1
        want = st.schedule.wants(st.step) or st.rewatch
        if st.rewatch:
            st.schedule.steady = False  # new inputs: keep watching until a watched step meets nothing new
            st.rewatch = False
        affordable = budget.affords(st.watch_cost_s, now - mode.started)
        st.watching = want and affordable
        st.reason = "steady_state" if not want else "budget"
        st.partial = False
        if st.watching:
            self._attach()
        else:
            self._detach()
            st.watching = self._entered  # a mode of the script's own above ours: keep watching
        st.signatures0 = len(mode.sampler.counts)
        st.t0 = time.perf_counter()
        st.spent0 = budget.spent()
        st.check0 = budget.check_s

    def _replay(self, reason: str, seen: dict[tuple[str, str], list[Any]] | None = None) -> None:
        """Record the calls of an unwatched step (or the unwatched rest of a step) as skipped for ``reason``."""
        profile = self._steps.profile
        if not profile or self._recorder is None:
            return
        seq = self._mode.seq
        for (op, phase), (calls, flops) in profile.items():
            done = seen.get((op, phase), [0, 0.0])[0] if seen else 0
            rest = calls - done
            if rest > 0:
                self._recorder.aggregate(seq, op, phase, None, reason, flops * rest / calls, None, calls=rest)

    def _write(self, final: bool) -> None:
        from tpudiag.model import OpDiff, OpRecord

        assert self._ctx is not None
        ops, diffs = self._recorder.drain(final)
        self._ctx.spool.write_records(OpRecord, ops)
        self._ctx.spool.write_records(OpDiff, diffs)

    def _announce(self, record: Any, diff: Any) -> None:
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
                status(_counts_line(f))

    def _clear_progress(self, erase: bool = False) -> None:
        """End the live line before other text; ``erase`` takes it off the terminal (the closing line follows)."""
        status = getattr(self, "_status", None)
        if status is not None:
            with contextlib.suppress(Exception):
                status.erase() if erase else status.done()

    def _register_compile_callback(self) -> None:
        with contextlib.suppress(Exception):
            from torch._dynamo.callback import callback_handler

            def on_start(*_args: Any, **_kwargs: Any) -> None:
                self._compiles += 1

            callback_handler.register_start_callback(on_start)
            self._compile_cb = on_start

    def _unregister_compile_callback(self) -> None:
        if self._compile_cb is None:
            return
        with contextlib.suppress(Exception):
            from torch._dynamo.callback import callback_handler

            callback_handler.remove_start_callback(self._compile_cb)


class _ModuleBoundaries:
    """The numerics collector's ``module_calls`` listener: root forwards (step boundaries in scripts without an
    optimizer, the root input probe) and budget detaches at module boundaries."""

    def __init__(self, collector: NumericsCollector) -> None:
        self._collector = collector

    def enter(self, module: Any, args: Any, kwargs: Any) -> None:
        c = self._collector
        if id(module) in c._probes:
            c._probe(module, args, kwargs)
        if c._module_hook_on:
            c._on_module(module, args)

    def exit(self, module: Any, token: Any, output: Any, failed: bool) -> None:
        return None


class _StepState:
    """Where the step schedule stands (see ``sampling.StepSchedule``)."""

    def __init__(self) -> None:
        from tpudiag.collectors.numerics.sampling import StepSchedule

        self.schedule = StepSchedule()
        self.step = 0
        self.watching = True
        self.partial = False  # the budget detached the mode inside the current step
        self.reason = "steady_state"  # why the current step is not watched
        self.t0 = 0.0
        self.spent0 = 0.0
        self.check0 = 0.0
        self.signatures0 = 0
        self.plain_s: float | None = None  # fastest unwatched step
        self.watch_cost_s = 0.0  # extra seconds the last watched step cost
        self.unmeasured: list[tuple[float, float]] = []  # (wall, charged) of watched steps before a plain one
        self.profile: dict[tuple[str, str], list[Any]] | None = None  # (op, phase) -> [calls, flops]
        self.watched = 0
        self.unwatched: dict[str, int] = {}
        self.budget_detaches = 0
        self.rewatch = False  # the root module saw new input shapes/dtypes while unwatched: watch the next step
        self.rewatches = 0


def _input_signature(args: Any, kwargs: Any) -> tuple[Any, ...]:
    """(shape, dtype) of every tensor among a module's inputs (top level and inside lists, tuples, dicts)."""
    import torch

    out: list[Any] = []
    todo: list[Any] = [args, kwargs]
    while todo and len(out) < 64:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype))
        elif isinstance(x, (list, tuple)):
            todo.extend(reversed(x))
        elif isinstance(x, dict):
            todo.extend(reversed(list(x.values())))
    return tuple(out)


def _on_top(mode: Any) -> bool:
    """Whether ``mode`` is the innermost dispatch mode (the only one that may be exited)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    current: Any = _get_current_dispatch_mode()
    return current is mode


def _calibrate_overhead(calls: int = 300) -> float:
    """Seconds a pass-through dispatch mode adds to one small op (charged to the budget per op seen)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Pass(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    x = torch.ones(4)
    costs = []
    for _ in range(4):  # the first round pays one-time setup: keep the cheapest
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.add(x, x)
        plain = time.perf_counter() - t0
        with _Pass():  # type: ignore[no-untyped-call]
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.add(x, x)
            moded = time.perf_counter() - t0
        costs.append((moded - plain) / calls)
    # The mode measures its own Python time per call; this is the part it cannot see (entering Python).
    return max(0.0, min(costs))


def _counts_line(f: Any) -> str:
    """The numerics counts, as the live status line and the closing line both say them."""
    return f"numerics: {f.seen:,} ops seen, {f.checked:,} checked, {f.originators} originator(s)"
