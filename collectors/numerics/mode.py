"""The dispatch mode that checks every aten op against the CPU float64 oracle, forward and backward.

For each op call: decide whether to check it (static skip reasons, filters, sampling, budget); copy its inputs to
the CPU *before* it runs when it mutates arguments; run the real op; re-run it on copies in float64 (and, off the
CPU, at the device dtype); compare each output; feed the shadow float64 stream that separates originators from
propagators.  The user's tensors are only ever read.

``ignore_compile_internals`` keeps the mode switched off while torch.compile traces and compiles, so compiled
code compiles exactly as without tpudiag; at run time the mode sees only the aten ops the compiled artifact calls
(e.g. extern matmuls), never the fused kernels, which the report lists as not covered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpudiag import internal_errors
from tpudiag.analysis.numerics_metrics import OutputMetrics, compare, dtype_name, is_discrete
from tpudiag.analysis.verdict import DIVERGENT, Evidence, Verdict, decide, eps_of, role, working_dtype
from tpudiag.collectors.numerics.records import Recorder, describe_inputs
from tpudiag.collectors.numerics.sampling import Budget, Sampler, SamplingOptions, module_matches, op_matches
from tpudiag.collectors.numerics.shadow import ShadowStream
from tpudiag.model import OpDiff, OpRecord
from tpudiag.oracle import ops as oracle
from tpudiag.oracle.copies import Float64Copies
from tpudiag.oracle.ops import OpPlan

DEFAULT_SIZE_CAP = 1 << 24
_MAX_DESCRIPTIONS = 1 << 16
# Kinds whose outputs combine terms, so cancellation can make a correct result tiny against its rounding error.
CANCELLING_KINDS = (
    "reduction",
    "matmul",
    "normalization",
    "elementwise",
    "special",
)  # elements per op (inputs and outputs): larger calls are skipped as "size_cap"

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIRS = tuple(os.path.dirname(os.path.abspath(p)) for p in (__file__, sys.modules["tpudiag"].__file__ or ""))
_SKIP_PREFIXES = (_TORCH_DIR, *_OWN_DIRS, os.path.dirname(os.__file__) + os.sep + "contextlib")


def user_source(depth: int = 2) -> str | None:
    """``file:line`` of the innermost Python frame outside torch and tpudiag (library code such as transformers
    counts as the user's: it is where the op was called)."""
    try:
        frame: Any = sys._getframe(depth)
    except ValueError:
        return None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP_PREFIXES) and not path.startswith("<frozen"):
            try:
                rel = os.path.relpath(path)
                shown = rel if not rel.startswith("..") else path
            except ValueError:
                shown = path
            return f"{shown}:{frame.f_lineno}"
        frame = frame.f_back
    return None


_FLOPS: dict[tuple[Any, ...], float] = {}
_MAX_FLOP_KEYS = 1 << 16


def _flops(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
    outputs: list[Any],
    signature: tuple[Any, ...] | None = None,
) -> float:
    """FLOPs of one call: torch's flop formulas (matmul, conv, attention), else one per output element.

    Formulas read only shapes (and, for convolutions, the scalar arguments): cached per signature and output shapes.
    """
    from torch.utils.flop_counter import flop_registry

    fn = flop_registry.get(getattr(func, "overloadpacket", None))
    if fn is not None:
        key: tuple[Any, ...] | None = None
        if signature is not None:
            # int[] arguments arrive as lists or tuples (conv stride/padding): keyed as nested tuples.
            scalars = tuple(
                _frozen(a) for a in args if isinstance(a, (int, float, bool, list, tuple)) and not _has_tensor(a)
            )
            outs = tuple(tuple(t.shape) for t in outputs if isinstance(t, torch.Tensor))
            key = (signature, scalars, outs)
            hit = _FLOPS.get(key)
            if hit is not None:
                return hit
        try:
            value = float(fn(*args, **kwargs, out_val=out))
        except Exception:
            value = float(sum(t.numel() for t in outputs if isinstance(t, torch.Tensor)))
        if key is not None and len(_FLOPS) < _MAX_FLOP_KEYS:
            _FLOPS[key] = value
        return value
    return float(sum(t.numel() for t in outputs if isinstance(t, torch.Tensor)))


def _frozen(x: Any) -> Any:
    return tuple(_frozen(y) for y in x) if isinstance(x, (list, tuple)) else x


def _has_tensor(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) or _has_tensor(y) for y in x)


@dataclass
class Context:
    """Per-run settings the mode needs besides sampling."""

    run_id: str
    device_kind: str = "cpu"
    emulations: tuple[str, ...] = ()  # reduced-precision matmul units to emulate: "bf16", "tf32"
    precision_json: str | None = None
    size_cap: int = DEFAULT_SIZE_CAP
    module_of: Callable[[str], str | None] | None = None  # phase -> current module path
    on_divergence: Callable[[OpRecord, OpDiff], None] | None = None


class NumericsMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(
        self,
        ctx: Context,
        options: SamplingOptions,
        recorder: Recorder,
        budget: Budget | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.active = True
        # Set when the mode's own per-op cost alone exceeds --budget: the collector then leaves the dispatch
        # stack at the next module boundary (a mode cannot pop itself from inside __torch_dispatch__).
        self.detach_requested = False
        self.ctx = ctx
        self.options = options
        self.recorder = recorder
        self.sampler = Sampler(options)
        self.budget = budget or Budget(options.budget_pct)
        self.shadow = ShadowStream()
        self.copies = Float64Copies()
        self._descriptions: dict[tuple[Any, ...], tuple[str, str, str]] = {}
        self._precision_cache: dict[tuple[tuple[str, str], ...], str] = {}
        self.clock = clock
        self.started = clock()
        self.seq = 0
        self.autocast_seen: set[str] = set()
        # (op, phase) -> [calls, flops] in the current step: replayed as skipped rows for unwatched steps.
        self.step_calls: dict[tuple[str, str], list[Any]] = {}
        # (op, phase) -> calls only counted because the budget was spent (recorded as "budget" by the collector).
        self.spent_calls: dict[tuple[str, str], int] = {}
        # Ops on which tpudiag itself failed once: run plainly from then on, counted as "tpudiag_error".
        self.broken: set[Any] = set()

    # -- dispatch -------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self.active or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        # The op itself runs exactly once, outside any tpudiag code: its own exceptions reach the script as they
        # would without tpudiag; tpudiag's (before or after it) are recorded and the op is not checked again.
        if func in self.broken:
            self._count_broken(func)
            return func(*args, **kwargs)
        try:
            pending = self._before(func, args, kwargs)
        except Exception as err:
            self._internal_error(func, err)
            return func(*args, **kwargs)
        if pending is None:
            return func(*args, **kwargs)
        t_op = self.clock()
        out = func(*args, **kwargs)
        op_s = self.clock() - t_op
        try:
            self._after(func, pending, args, kwargs, out, op_s)
        except Exception as err:
            self._internal_error(func, err)
        return out

    def _before(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Pending | None:
        """Everything before the op runs: counting, the skip decision, snapshots of what the op will write."""
        t_entry = self.clock()
        self.seq += 1
        seq = self.seq
        self.budget.ops_seen += 1
        if seq % 64 == 0 and self.budget.exhausted(t_entry - self.started):
            self.detach_requested = True
        self.recorder.findings.seen += 1
        plan = oracle.plan_for(func)
        if plan.mutates and len(self.copies):
            # Its written arguments' kept copies are stale once it runs (fused and foreach ops write without a
            # version bump under a dispatch mode): dropped now, whether or not this call is checked.
            self.copies.forget(
                [t for t in oracle.tree_flatten(oracle.written_values(plan, args, kwargs))[0] if _strided(t)]
            )
        phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
        key = (plan.name, phase)
        calls = self.step_calls.get(key)
        if calls is None:
            self.step_calls[key] = [1, 0.0]
        else:
            calls[0] += 1
        if self.detach_requested:
            # Budget spent, mode still on the stack until a safe point: count the call, nothing else.
            self.spent_calls[key] = self.spent_calls.get(key, 0) + 1
            return None
        module = self.ctx.module_of(phase) if self.ctx.module_of is not None else None
        tensors = oracle.tensors_in(args, kwargs)
        reason, signature = self._skip_reason(func, plan, module, tensors, t_entry)
        pending = _Pending(plan, seq, module, phase, tensors, signature, reason, t_entry)
        if reason is not None:
            return pending
        pending.t_check = self.clock()
        if plan.mutates:
            # Arguments the op writes (and any argument sharing their storage), as they were before the write.
            with _tool_range():
                pending.snap, pending.fresh = _snapshot(plan, args, kwargs, tensors)
        if len(self.shadow) and self.shadow.has_any(tensors):
            for t in tensors:
                sh = self.shadow.get(t)
                if sh is not None:
                    pending.shadow_subst[id(t)] = sh
        return pending

    def _after(
        self, func: Any, p: _Pending, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, op_s: float
    ) -> None:
        if p.reason is not None:
            self._unchecked(func, p.plan, p.seq, p.module, p.phase, p.reason, args, kwargs, out, p.tensors, p.signature)
            # The mode's own time on this call (everything but the op itself) counts against --budget.
            self.budget.extra_s += self.clock() - p.t_entry - op_s
            return
        self._check(func, p, args, kwargs, out, op_s)

    def _internal_error(self, func: Any, err: Exception) -> None:
        """tpudiag failed on this call: recorded, the call counted as skipped, the op never checked again."""
        name = _op_name(func)
        internal_errors.current().record("numerics", name, err)
        self.broken.add(func)
        self._count_broken(func)

    def _count_broken(self, func: Any) -> None:
        try:
            phase = "backward" if torch._C._current_graph_task_id() >= 0 else "forward"
            self.recorder.aggregate(self.seq, _op_name(func), phase, None, "tpudiag_error", 0.0, None)
        except Exception:
            pass

    def _skip_reason(
        self, func: Any, plan: OpPlan, module: str | None, tensors: list[torch.Tensor], now: float
    ) -> tuple[str | None, tuple[Any, ...] | None]:
        if plan.skip is not None:
            return plan.skip, None
        if not tensors:
            return "factory", None
        if not self.options.enabled:
            return "off", None
        if not op_matches(plan.name, self.options.ops) or not module_matches(module, self.options.modules):
            return "filtered", None
        problem = oracle.input_problem(tensors)
        if problem is not None:
            return problem, None
        signature = (func, *[(t.shape, t.dtype) for t in tensors])
        # Sampling keys on the first 8 tensor inputs (ops taking tensor lists would make every call new).
        sampled_as = signature if len(signature) <= 9 else signature[:9]
        if not self.sampler.wants(sampled_as):
            return "sampled", signature
        numel = sum(t.numel() for t in tensors)
        if numel > self.ctx.size_cap:
            return "size_cap", signature
        if self.budget.pct is not None and not self.budget.allows_check(
            plan.name, plan.kind, numel, now - self.started, self.sampler.checked.get(sampled_as, 0)
        ):
            self.sampler.refused(sampled_as)
            return "budget", signature
        return None, signature

    # -- unchecked calls ------------------------------------------------------------------------------------
    def _unchecked(
        self,
        func: Any,
        plan: OpPlan,
        seq: int,
        module: str | None,
        phase: str,
        reason: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        tensors: list[torch.Tensor],
        signature: tuple[Any, ...] | None,
    ) -> None:
        if len(self.shadow) or (plan.is_view and len(self.copies)):
            with _tool_range():
                self._carry_shadow(func, plan, args, kwargs, out, tensors)
        outputs = oracle.targets(plan, args, kwargs, out)
        if reason in ("sampled", "filtered", "budget", "off"):
            described = self._described(signature, tensors)
            flops = (
                _flops(func, args, kwargs, out, outputs, signature)
                if plan.kind == "matmul"
                else float(sum(t.numel() for t in outputs if isinstance(t, torch.Tensor)))
            )
            self.recorder.aggregate(seq, plan.name, phase, module, reason, flops, described[2])
            self.step_calls[(plan.name, phase)][1] += flops
            return
        flops = _flops(func, args, kwargs, out, outputs, signature)
        self.step_calls[(plan.name, phase)][1] += flops
        dtypes, shapes, _ = self._described(signature, tensors)
        self.recorder.op(
            OpRecord(
                run_id=self.ctx.run_id,
                seq=seq,
                op=plan.name,
                overload=plan.overload,
                module=module,
                phase=phase,
                source_loc=user_source(3),
                dtypes=dtypes,
                shapes=shapes,
                device=_device(tensors),
                checked=False,
                skip_reason=reason,
                flops=flops,
                kind=plan.kind,
            )
        )

    def _described(self, signature: tuple[Any, ...] | None, tensors: list[torch.Tensor]) -> tuple[str, str, str]:
        """(dtypes JSON, shapes JSON, sorted distinct dtypes JSON) of the inputs, cached per signature."""
        hit = self._descriptions.get(signature) if signature is not None else None
        if hit is None:
            dtypes, shapes = describe_inputs(tensors)
            hit = (dtypes, shapes, json.dumps(sorted({dtype_name(t.dtype) for t in tensors})))
            if signature is not None and len(self._descriptions) < _MAX_DESCRIPTIONS:
                self._descriptions[signature] = hit
        return hit

    def _carry_shadow(
        self,
        func: Any,
        plan: OpPlan,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        out: Any,
        tensors: list[torch.Tensor],
    ) -> None:
        """Views of a tensor with a shadow get the same view of the shadow; anything else loses its shadow.

        Views also carry a kept float64 copy (the same view of it), when it has the layout a fresh copy would have.
        """
        if plan.is_view and plan.skip == "view" and tensors and isinstance(out, torch.Tensor):
            if len(self.shadow) and self.shadow.get(tensors[0]) is not None:
                try:
                    a64, k64 = oracle.convert(args, kwargs, oracle.float64_of, self.shadow.get)
                    view = func(*a64, **k64)
                    if isinstance(view, torch.Tensor) and view.shape == out.shape:
                        self.shadow.set(out, view)
                except Exception:
                    pass
            if len(self.copies) and out.device.type == "cpu" and out.dtype.is_floating_point:
                self._carry_copy(func, args, kwargs, out, tensors[0])
            return
        if len(self.shadow):
            for w in oracle.targets(plan, args, kwargs, out):
                if isinstance(w, torch.Tensor):
                    self.shadow.forget(w)

    def _carry_copy(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: torch.Tensor, base: torch.Tensor
    ) -> None:
        kept = self.copies.get(base)
        if kept is None or kept.stride() != base.stride() or kept.storage_offset() != base.storage_offset():
            return
        # Only where a fresh copy of the view would have the view's own strides (dense, non-overlapping): then the
        # oracle sees exactly the layout it would have seen without the cache.
        if not _dense(out):
            return
        try:
            view = func(kept, *args[1:], **kwargs)
        except Exception:
            return
        if isinstance(view, torch.Tensor) and view.shape == out.shape and view.stride() == out.stride():
            self.copies.put(out, view)

    # -- checked calls --------------------------------------------------------------------------------------
    def _check(
        self, func: Any, p: _Pending, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, op_s: float
    ) -> None:
        plan, seq, module, phase, tensors, signature = p.plan, p.seq, p.module, p.phase, p.tensors, p.signature
        snap, fresh, shadow_subst, t0 = p.snap, p.fresh, p.shadow_subst, p.t_check
        src_args, src_kwargs = snap if snap is not None else (args, kwargs)
        outputs = oracle.targets(plan, args, kwargs, out)
        dtypes, shapes, _ = self._described(signature, tensors)
        flops = _flops(func, args, kwargs, out, outputs, signature)
        checked, skip_reason = True, None
        try:
            with _tool_range():
                diffs = self._compare(
                    func, plan, seq, src_args, src_kwargs, args, kwargs, outputs, tensors, shadow_subst, fresh
                )
            if self.ctx.device_kind == "cpu" and any(d.role == "originator" for d in diffs):
                diffs = self._confirm(func, plan, seq, src_args, src_kwargs, args, kwargs, outputs, tensors, p, diffs)
        except _OracleFailed as failed:
            checked, skip_reason = False, failed.reason
            diffs = []
        check_s = self.clock() - t0 - op_s
        self.budget.charge(check_s, plan.name, plan.kind, sum(t.numel() for t in tensors))
        if signature is not None and checked:
            sampled_as = signature if len(signature) <= 9 else signature[:9]
            self.sampler.checked[sampled_as] = self.sampler.checked.get(sampled_as, 0) + 1
        divergent = [d for d in diffs if d.role is not None]
        originator = any(d.role == "originator" for d in divergent)
        source = user_source(3) if divergent or skip_reason is not None else None
        record = OpRecord(
            run_id=self.ctx.run_id,
            seq=seq,
            op=plan.name,
            overload=plan.overload,
            module=module,
            phase=phase,
            source_loc=source,
            dtypes=dtypes,
            shapes=shapes,
            device=_device(tensors),
            checked=checked,
            skip_reason=skip_reason,
            flops=flops,
            kind=plan.kind,
            duration_ns=int(op_s * 1e9),
            check_ns=int(check_s * 1e9),
        )
        if originator:
            cpu_args, cpu_kwargs = oracle.convert(src_args, src_kwargs, lambda d: d)
            path = self.recorder.save_repro(
                seq,
                func,
                cpu_args,
                cpu_kwargs,
                {
                    "module": module,
                    "phase": phase,
                    "source": record.source_loc,
                    "device": self.ctx.device_kind,
                    "dtypes": dtypes,
                    "run_id": self.ctx.run_id,
                },
            )
            if path is not None:
                diffs = [_replace(d, repro_path=path) if d.role == "originator" else d for d in diffs]
        self.step_calls[(plan.name, phase)][1] += flops
        findings = self.recorder.findings
        findings.checked += checked
        self.recorder.op(record)
        self.recorder.diffs(diffs)
        if divergent:
            findings.divergent += 1
            if originator:
                findings.originators += 1
                if findings.first is None:
                    findings.first = f"{plan.name} seq {seq} ({module or 'no module'})"
                if self.ctx.on_divergence is not None:
                    self.ctx.on_divergence(record, divergent[0])

    def _confirm(
        self,
        func: Any,
        plan: OpPlan,
        seq: int,
        src_args: tuple[Any, ...],
        src_kwargs: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs: list[Any],
        tensors: list[torch.Tensor],
        p: _Pending,
        diffs: list[OpDiff],
    ) -> list[OpDiff]:
        """An originator's verdict, judged again from fresh copies of its inputs, exactly as its repro bundle will be.

        The in-run verdict and the repro must agree: the first judgement may read kept float64 copies, so an
        originator is judged once more without them (rare: divergent calls only).  Should the two differ, the kept
        copy was stale, which is tpudiag's fault: recorded as an internal error, the fresh verdict stands.
        """
        with _tool_range():
            fresh = self._compare(
                func,
                plan,
                seq,
                src_args,
                src_kwargs,
                args,
                kwargs,
                outputs,
                tensors,
                p.shadow_subst,
                p.fresh,
                use_copies=False,
            )
        if [(d.verdict, d.role) for d in fresh] != [(d.verdict, d.role) for d in diffs]:
            try:
                raise RuntimeError(f"a kept float64 copy disagreed with a fresh one ({plan.name} seq {seq})")
            except RuntimeError as err:
                internal_errors.current().record("numerics", plan.name, err)
        return fresh

    def _compare(
        self,
        func: Any,
        plan: OpPlan,
        seq: int,
        src_args: tuple[Any, ...],
        src_kwargs: dict[str, Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        outputs: list[Any],
        tensors: list[torch.Tensor],
        shadow_subst: dict[int, torch.Tensor],
        fresh: set[int],
        use_copies: bool = True,
    ) -> list[OpDiff]:
        storage = plan.name.split("::")[-1] in oracle.STORAGE_OPS
        convert = oracle.convert_storage_faithful if storage else oracle.convert
        copies = self.copies if use_copies and not storage and self.ctx.device_kind == "cpu" else None
        _, _, expected = self._run(func, plan, src_args, src_kwargs, convert, oracle.float64_of, copies=copies)
        if len(expected) != len(outputs):
            raise _OracleFailed("output_mismatch")
        reference: list[Any] | None = None
        if self.ctx.device_kind != "cpu" and any(
            isinstance(t, torch.Tensor) and t.device.type != "cpu" for t in outputs
        ):
            try:
                reference = self._run(func, plan, src_args, src_kwargs, convert, lambda d: d)[2]
            except _OracleFailed:
                reference = None
        shadowed: list[Any] | None = None
        if shadow_subst:
            by_id = {
                id(t): s
                for t, s in zip(oracle.tensors_in(args, kwargs), oracle.tensors_in(src_args, src_kwargs), strict=False)
            }

            def substitute(x: torch.Tensor) -> torch.Tensor | None:
                if id(x) in shadow_subst:
                    return shadow_subst[id(x)]
                return by_id.get(id(x))

            try:
                shadowed = self._run(func, plan, args, kwargs, convert, oracle.float64_of, substitute)[2]
            except _OracleFailed:
                shadowed = None
        red_len = oracle.reduction_len(plan, tensors, outputs)
        in_dtypes = {dtype_name(t.dtype) for t in tensors}
        diffs: list[OpDiff] = []
        for i, (dev, exp) in enumerate(zip(outputs, expected, strict=True)):
            skip = plan.skip_outputs.get(i)
            dev_t = oracle.as_tensor(dev)
            exp_t = oracle.as_tensor(exp)
            if skip is None and (dev_t.layout != torch.strided or exp_t.layout != torch.strided):
                # Sparse results are compared as the dense tensors they stand for (the metrics need strided data).
                dev_t, exp_t = _dense_of(dev_t), _dense_of(exp_t)
            if skip is None and dev_t.shape != exp_t.shape:
                skip = "shape_mismatch"
            if skip is None and dev_t.numel() > self.ctx.size_cap:
                skip = "size_cap"
            if skip is not None:
                diffs.append(
                    OpDiff(
                        run_id=self.ctx.run_id,
                        seq=seq,
                        output_index=i,
                        verdict="skip",
                        dtype=dtype_name(dev_t.dtype),
                        numel=int(dev_t.numel()),
                        skip_reason=skip,
                    )
                )
                continue
            device_cpu = dev_t.detach().to("cpu")
            # The output in float64: compared in float64 only, then kept for the ops that read this tensor next.
            dev64 = (
                device_cpu.to(torch.float64, copy=True)
                if device_cpu.dtype.is_floating_point and device_cpu.dtype != torch.float64
                else None
            )
            m = compare(device_cpu, exp_t, detail=False, actual64=dev64)
            ref_m = (
                compare(oracle.as_tensor(reference[i]).to("cpu"), exp_t, detail=False)
                if reference is not None
                else None
            )
            ev = Evidence(
                dtype=m.dtype,
                kind=plan.kind,
                scaled_error=m.scaled_error,
                ref_scaled_error=ref_m.scaled_error if ref_m else None,
                overflow=m.overflow,
                nonfinite_mismatch=m.nonfinite_mismatch,
                mismatch_rate=m.mismatch_rate,
                reduction_len=red_len,
            )
            # A mixed-precision kernel (bf16 inputs, float32 output) is judged at its least precise input.
            at = working_dtype(m.dtype, in_dtypes)
            factor = eps_of(m.dtype) / eps_of(at) if at != m.dtype else 1.0
            verdict = _decide_at(ev, at, factor)
            if verdict.verdict != "pass" and m.max_ulp is None and m.mismatch_rate is None:
                m = compare(device_cpu, exp_t)  # the full metric set, for what will be reported
            if verdict.verdict == "fail" and plan.kind in CANCELLING_KINDS and m.max_abs is not None:
                # Cancellation: a sum's rounding error is bounded by eps x the sum of the magnitudes of its terms,
                # not by its (possibly tiny) result.  Re-scale by the op run on the inputs' absolute values.
                bound = self._magnitude(func, plan, src_args, src_kwargs, i)
                if bound is not None and m.scale is not None and bound > m.scale:
                    rescaled = m.max_abs / (eps_of(m.dtype) * bound)
                    m = dataclasses.replace(m, scaled_error=rescaled, scale=bound)
                    ev = dataclasses.replace(ev, scaled_error=rescaled)
                    verdict = _decide_at(ev, at, factor)
            emulated: float | None = None
            if verdict.verdict == "fail" and plan.kind == "matmul" and m.dtype == "float32" and self.ctx.emulations:
                emulated = self._emulated_error(func, plan, src_args, src_kwargs, i, exp_t)
                if emulated is not None:
                    verdict = _decide_at(Evidence(**{**ev.__dict__, "emulated_scaled_error": emulated}), at, factor)
            prop_err: float | None = None
            prop_div = False
            if shadowed is not None and i < len(shadowed) and not is_discrete(dev_t.dtype):
                sm = compare(device_cpu, oracle.as_tensor(shadowed[i]), detail=False, actual64=dev64)
                prop_err = sm.scaled_error
                prop_div = (
                    _decide_at(
                        Evidence(
                            dtype=sm.dtype,
                            kind=plan.kind,
                            scaled_error=sm.scaled_error,
                            overflow=sm.overflow,
                            nonfinite_mismatch=sm.nonfinite_mismatch,
                            reduction_len=red_len,
                        ),
                        at,
                        factor,
                    ).verdict
                    in DIVERGENT
                )
                if prop_div and _strided(dev):
                    self.shadow.set(dev, oracle.as_tensor(shadowed[i]))
            if not prop_div and _strided(dev):
                if verdict.verdict in DIVERGENT and not is_discrete(dev_t.dtype):
                    self.shadow.set(dev, exp_t)
                else:
                    self.shadow.forget(dev)
            if dev64 is not None and copies is not None and _strided(dev) and id(dev) not in fresh:
                copies.put(dev, dev64)
            diffs.append(
                self._diff_row(seq, i, m, ref_m, verdict, role(verdict.verdict, prop_div), prop_err, emulated, plan)
            )
        return diffs

    def _run(
        self,
        func: Any,
        plan: OpPlan,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        convert: Any,
        dtype_fn: Callable[[torch.dtype], torch.dtype],
        substitute: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
        copies: Float64Copies | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any], list[Any]]:
        try:
            if substitute is not None:
                a, k = oracle.convert(args, kwargs, dtype_fn, substitute)
            elif copies is not None:
                a, k = oracle.convert(args, kwargs, dtype_fn, copies=copies)
            else:
                a, k = convert(args, kwargs, dtype_fn)
            result = func(*a, **k)
        except NotImplementedError:
            raise _OracleFailed("no_cpu_kernel") from None
        except Exception as err:
            text = str(err)
            reason = "no_cpu_kernel" if "not implemented for" in text or "NotImplemented" in text else "oracle_error"
            raise _OracleFailed(reason) from None
        return a, k, oracle.targets(plan, a, k, result)

    def _magnitude(
        self, func: Any, plan: OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any], index: int
    ) -> float | None:
        """max |op(|inputs|)| for output ``index``: the magnitude its rounding errors scale with."""

        def absolute(t: torch.Tensor) -> torch.Tensor | None:
            return t.detach().abs() if (t.is_floating_point() or t.is_complex()) else None

        try:
            a, k = oracle.convert(args, kwargs, oracle.float64_of, absolute)
            res = oracle.targets(plan, a, k, func(*a, **k))
            value = oracle.as_tensor(res[index]).abs()
            finite = value[torch.isfinite(value)]
            return float(finite.max().item()) if finite.numel() else None
        except Exception:
            return None

    def _emulated_error(
        self, func: Any, plan: OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any], index: int, expected: torch.Tensor
    ) -> float | None:
        best: float | None = None
        for _, cast in oracle.emulation_casts(list(self.ctx.emulations)):
            try:
                a, k = oracle.emulate_inputs(args, kwargs, cast)
                res = oracle.targets(plan, a, k, func(*a, **k))
                m = compare(oracle.as_tensor(res[index]).to(torch.float32), expected)
            except Exception:
                continue
            if m.scaled_error is not None:
                best = m.scaled_error if best is None else max(best, m.scaled_error)
        return best

    def _diff_row(
        self,
        seq: int,
        index: int,
        m: OutputMetrics,
        ref: OutputMetrics | None,
        verdict: Verdict,
        op_role: str | None,
        prop_err: float | None,
        emulated: float | None,
        plan: OpPlan,
    ) -> OpDiff:
        return OpDiff(
            run_id=self.ctx.run_id,
            seq=seq,
            output_index=index,
            verdict=verdict.verdict,
            role=op_role,
            dtype=m.dtype,
            numel=m.numel,
            max_abs=m.max_abs,
            max_rel=m.max_rel,
            mean_abs=m.mean_abs,
            rmse=m.rmse,
            cosine=m.cosine,
            max_ulp=m.max_ulp,
            mean_ulp=m.mean_ulp,
            scaled_error=m.scaled_error,
            ref_scaled_error=ref.scaled_error if ref else None,
            propagated_error=prop_err,
            threshold=verdict.threshold,
            nan_device=m.nan_device,
            inf_device=m.inf_device,
            nan_oracle=m.nan_oracle,
            inf_oracle=m.inf_oracle,
            mismatch_rate=m.mismatch_rate,
            note=verdict.note,
            emulated_error=emulated,
            precision=self._precision_now() if plan.kind == "matmul" else None,
        )

    def _precision_now(self) -> str | None:
        """The run's matmul precision knobs plus the autocast state when this op ran (JSON cached per state)."""
        autocast = {}
        for dev in ("cpu", "cuda", "tpu"):
            try:
                if torch.is_autocast_enabled(dev):
                    autocast[dev] = dtype_name(torch.get_autocast_dtype(dev))
            except Exception:
                continue
        state = tuple(sorted(autocast.items()))
        text = self._precision_cache.get(state)
        if text is None:
            self.autocast_seen.update(autocast)
            base = json.loads(self.ctx.precision_json) if self.ctx.precision_json else {}
            if autocast:
                base["autocast"] = autocast
            text = self._precision_cache[state] = json.dumps(base, sort_keys=True)
        return text


@dataclass
class _Pending:
    """What ``_before`` learnt about a call, for ``_after`` once the op has run."""

    plan: OpPlan
    seq: int
    module: str | None
    phase: str
    tensors: list[torch.Tensor]
    signature: tuple[Any, ...] | None
    reason: str | None  # why the call is not checked, or None
    t_entry: float
    snap: tuple[tuple[Any, ...], dict[str, Any]] | None = None
    fresh: set[int] = dataclasses.field(default_factory=set)
    shadow_subst: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)
    t_check: float = 0.0


def _decide_at(ev: Evidence, at: str, factor: float) -> Verdict:
    """``decide`` at dtype ``at`` (eps ``1/factor`` times the output's); the threshold kept in the output's eps."""
    if factor == 1.0:
        return decide(ev)

    def scaled(x: float | None) -> float | None:
        return None if x is None else x * factor

    v = decide(
        dataclasses.replace(
            ev,
            dtype=at,
            scaled_error=scaled(ev.scaled_error),
            ref_scaled_error=scaled(ev.ref_scaled_error),
            emulated_scaled_error=scaled(ev.emulated_scaled_error),
        )
    )
    note = f"judged at {at}, its least precise input" + (f": {v.note}" if v.note else "")
    return Verdict(v.verdict, None if v.threshold is None else v.threshold / factor, note)


def _op_name(func: Any) -> str:
    try:
        return f"{getattr(func, 'namespace', 'aten')}::{func.overloadpacket.__name__}"
    except Exception:
        return str(func)


class _OracleFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _replace(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


def _device(tensors: list[torch.Tensor]) -> str | None:
    for t in tensors:
        if t.device.type != "cpu":
            return str(t.device)
    return "cpu" if tensors else None


# The checker's own work runs inside this profiler range, so a trace captured beside it can tell the script's ops
# from the oracle's (tpudiag.traces.kineto marks everything under it as tool overhead, never as a slow op).
TOOL_RANGE = "tpudiag::numerics"


def _tool_range() -> Any:
    """The tool range while a profiler records (a trace is being captured), else nothing to pay for."""
    if torch._C._autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(TOOL_RANGE)
    return contextlib.nullcontext()


def _strided(x: Any) -> bool:
    """A tensor with storage of its own layout (the shadow stream and the copy cache key on its storage)."""
    return isinstance(x, torch.Tensor) and x.layout == torch.strided


def _dense_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.layout != torch.strided else t


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: ``to(copy=True)`` keeps such a tensor's strides."""
    if t.is_contiguous():
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape, strict=True) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _snapshot(
    plan: OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[torch.Tensor]
) -> tuple[tuple[tuple[Any, ...], dict[str, Any]], set[int]]:
    """The arguments with every tensor the op may change replaced by a CPU copy taken now, before the op runs.

    Changed: the written arguments and any other argument sharing storage with one of them.  The rest are the
    user's own tensors (the op does not change them).  Returns the arguments and the ids of the copies.
    """
    written = {
        id(t) for t in oracle.tree_flatten(oracle.written_values(plan, args, kwargs))[0] if isinstance(t, torch.Tensor)
    }
    storages = {t.untyped_storage().data_ptr() for t in tensors if id(t) in written}
    fresh: set[int] = set()
    copied: dict[int, torch.Tensor] = {}

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in written or x.untyped_storage().data_ptr() in storages:
            c = copied.get(id(x))
            if c is None:
                c = copied[id(x)] = x.detach().to("cpu", copy=True)
                fresh.add(id(c))
            return c
        return x

    return (oracle.tree_map(one, args), oracle.tree_map(one, kwargs)), fresh
