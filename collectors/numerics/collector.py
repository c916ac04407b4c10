"""The ``numerics`` collector: the dispatch mode around the whole script, rows spooled as it goes.

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

    Post hooks run innermost first, so a node gets the innermost module whose forward created it.
    """

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker
        self._handle: Any = None

    def install(self) -> None:
        from torch.nn.modules import module as nn_module

        self._handle = nn_module.register_module_forward_hook(self._post)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()

    def _post(self, module: Any, args: Any, output: Any) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        if torch.compiler.is_compiling() or not torch.is_grad_enabled():
            return
        with contextlib.suppress(Exception):
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
        self._detach_hook: Any = None
        self._detached_at: int | None = None

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
        self._tracker.install()
        self._backward = _BackwardModules(self._tracker)
        self._backward.install()
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
        if options.budget_pct is not None:
            from torch.nn.modules import module as nn_module

            self._detach_hook = nn_module.register_module_forward_pre_hook(self._maybe_detach)
        if options.enabled:
            self._mode.__enter__()
            self._entered = True
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
        self._clear_progress()
        parts: list[Any] = [self._tracker, self._backward, self._detach_hook]
        for part in parts:
            with contextlib.suppress(Exception):
                part.remove()
        self._unregister_compile_callback()
        self._write(final=True)
        f = self._recorder.findings
        self._settings.update(
            {
                "compiled_frames": self._compiles,
                "seconds_checking": round(self._mode.budget.extra_s, 3),
                "shadow_dropped": self._mode.shadow.dropped,
            }
        )
        self._settings["precision"]["autocast_seen"] = sorted(self._mode.autocast_seen)
        path = self._ctx.run_dir / "numerics" / "settings.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self._settings, indent=1))
        if self._detached_at is not None:
            self._settings["detached_after_ops"] = self._detached_at
            self._ctx.note(
                f"numerics: stopped watching ops after {self._detached_at}: the dispatch mode's own cost exceeded "
                "--budget (ops after that were neither seen nor checked)"
            )
        if self._compiles:
            self._ctx.note(
                f"numerics: {self._compiles} torch.compile frame(s) compiled normally; their fused kernels are "
                "not checked (aten ops they call are)"
            )
        if f.seen == 0:
            self._ctx.note("numerics: no aten ops were seen (did the script run any torch ops?)")
        elif f.checked == 0:
            self._ctx.note(f"numerics: WARNING: {f.seen} ops seen but none checked (see the report's coverage)")
        sys.stderr.write(
            f"tpudiag: numerics: {f.seen} ops seen, {f.checked} checked, {f.originators} originator(s)"
            + (f", first divergence {f.first}" if f.first else "")
            + "\n"
        )
        sys.stderr.flush()

    # -- helpers ----------------------------------------------------------------------------------------------
    def _maybe_detach(self, module: Any, args: Any) -> None:
        """Leave the dispatch stack when the mode alone costs more than --budget (a module boundary is safe)."""
        mode: Any = self._mode
        if not self._entered or mode is None or not mode.detach_requested:
            return
        if _on_top(mode):
            mode.__exit__(None, None, None)
            mode.active = False
            self._entered = False
            self._detached_at = mode.seq

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
                f"tpudiag: numerics: first divergence: {record.op} seq {record.seq} "
                f"({record.module or 'no module'}, {record.phase}, {record.source_loc or '?'}): {diff.verdict}\n"
            )
            sys.stderr.flush()

    def _progress_loop(self) -> None:
        tty = sys.stderr.isatty()
        interval = PROGRESS_INTERVAL_TTY_S if tty else PROGRESS_INTERVAL_PIPE_S
        while not self._progress_stop.wait(interval):
            f = self._recorder.findings
            line = (
                f"tpudiag numerics: {f.seen:,} ops seen, {f.checked:,} checked, {f.originators} originator(s), "
                f"{f.divergent} divergent"
            )
            with contextlib.suppress(Exception):
                if tty:
                    sys.stderr.write("\r" + line[:120] + "\033[K")
                else:
                    sys.stderr.write(line + "\n")
                sys.stderr.flush()

    def _clear_progress(self) -> None:
        if sys.stderr.isatty():
            with contextlib.suppress(Exception):
                sys.stderr.write("\r\033[K")

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
