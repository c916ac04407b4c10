"""The dispatch mode that checks every aten op against the CPU float64 oracle, forward and backward.

This module is the dispatch itself (what to check, snapshots, the check's bookkeeping); the per-output judging is
``judge.py``, the oracle re-runs and rows ``oracle_runs.py``, unchecked calls ``unchecked.py``, op cost ``op_cost.py``.

For each op call: decide whether to check it (static skip reasons, filters, sampling, budget); copy its inputs to
the CPU *before* it runs when it mutates arguments; run the real op; re-run it on copies in float64 (and, off the
CPU, at the device dtype); compare each output; feed the shadow float64 stream that separates originators from
propagators.  The user's tensors are only ever read.

``ignore_compile_internals`` keeps the mode switched off while torch.compile traces and compiles, so compiled
code compiles exactly as without tpudiag; at run time the mode sees only the aten ops the compiled artifact calls
(e.g. extern matmuls), never the fused kernels, which the report lists as not covered.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tpudiag import internal_errors
from tpudiag.collectors.numerics import check_memory
from tpudiag.collectors.numerics.context import Context
from tpudiag.collectors.numerics.grad_scaler import ScalerWatch
from tpudiag.collectors.numerics.judge import OutputJudge
from tpudiag.collectors.numerics.op_cost import _device, _flops, user_source
from tpudiag.collectors.numerics.oracle_runs import OracleRuns, _OracleFailed, _strided, _tool_range
from tpudiag.collectors.numerics.records import Recorder
from tpudiag.collectors.numerics.sampling import Budget, Sampler, SamplingOptions, module_matches, op_matches
from tpudiag.collectors.numerics.shadow import ShadowStream
from tpudiag.collectors.numerics.unchecked import UncheckedCalls
from tpudiag.longrun import heap
from tpudiag.model import OpRecord
from tpudiag.oracle import ops as oracle
from tpudiag.oracle.copies import Float64Copies
from tpudiag.oracle.ops import OpPlan

__all__ = ["Context", "NumericsMode"]

_MAX_DESCRIPTIONS = 1 << 16
# After checking an op this large (its tensors' elements), the float64 replay's temporaries are handed back to the
# system (glibc kept them: a trace window checking 2M-element sorts step after step held +430 MB until its close;
# a trim costs 2-10 ms after such a check, a few percent of it, and at most one every TRIM_INTERVAL_S).
TRIM_AFTER_NUMEL = 1 << 20
TRIM_INTERVAL_S = 0.5


class NumericsMode(UncheckedCalls, OutputJudge, OracleRuns, TorchDispatchMode):  # type: ignore[no-untyped-call]
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
        # Set when a capped step's check time is up (``_time_up``): its remaining calls are only counted.
        self.counting_only = False
        self.time_ups = 0  # steps whose check time ran out before their end
        self.ctx = ctx
        self.options = options
        self.recorder = recorder
        self.sampler = Sampler(options)
        self.budget = budget or Budget(options.budget_pct)
        self.shadow = ShadowStream()
        self.scalers = ScalerWatch()
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
        until = self.sampler.check_until
        if self.detach_requested or self.counting_only or (until is not None and t_entry > until and self._time_up()):
            # Budget spent, mode still on the stack until a safe point, or this step's check time is up: count the
            # call, nothing else.
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

    def _time_up(self) -> bool:
        """This step's check time has run out (``Sampler.check_until``): its remaining calls are only counted, as
        calls the budget refused, until the step ends (``counting_only``, cleared at the next step's start).  The
        checks stop at that clock; without this the mode's own work on every later call of the step went on (on a
        slow machine ~0.15 ms a call: a 200-op step's pass-through alone stalled it ~30 ms more)."""
        self.counting_only = True
        self.time_ups += 1
        self.sampler.ran_out()
        return True

    def _after(
        self, func: Any, p: _Pending, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, op_s: float
    ) -> None:
        if p.reason is None and p.signature is not None:
            if self.sampler.too_late(_sampled_as(p.signature), op_s):
                p.reason = "budget"
            elif (cap := self.sampler.memory_cap) is not None and check_memory.estimate(p.tensors, out) > cap:
                p.reason = "size_cap"  # past the run's first steps: more than a check may hold (``check_memory``)
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
        sampled_as = _sampled_as(signature)
        if not self.sampler.wants(sampled_as):
            return "sampled", signature
        numel = sum(t.numel() for t in tensors)
        if numel > self.ctx.size_cap:
            return "size_cap", signature
        if not self.sampler.in_time(sampled_as, lambda: self.budget.cautious_estimate(plan.name, plan.kind, numel)):
            return "budget", signature
        if self.budget.pct is not None and not self.budget.allows_check(
            plan.name, plan.kind, numel, now - self.started, self.sampler.checked.get(sampled_as, 0)
        ):
            self.sampler.refused(sampled_as)
            return "budget", signature
        return None, signature

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
                diffs = self._confirm(
                    func, plan, seq, src_args, src_kwargs, args, kwargs, outputs, tensors, shadow_subst, fresh, diffs
                )
        except _OracleFailed as failed:
            checked, skip_reason = False, failed.reason
            diffs = []
        check_s = self.clock() - t0 - op_s
        numel = sum(t.numel() for t in tensors)
        self.budget.charge(check_s, plan.name, plan.kind, numel)
        if numel >= TRIM_AFTER_NUMEL:
            heap.release(min_interval_s=TRIM_INTERVAL_S, caller="large check")
        if signature is not None and checked:
            sampled_as = _sampled_as(signature)
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
        if any(d.verdict == "scaled_overflow" for d in diffs):
            findings.scaled_overflows += 1
        if divergent:
            findings.divergent += 1
            if originator:
                findings.originators += 1
                if findings.first is None:
                    findings.first = f"{plan.name} seq {seq} ({module or 'no module'})"
                if self.ctx.on_divergence is not None:
                    self.ctx.on_divergence(record, divergent[0])


def _sampled_as(signature: tuple[Any, ...]) -> tuple[Any, ...]:
    """What sampling keys a call on: the op and its first 8 tensor inputs (ops taking tensor lists would make every
    call new)."""
    return signature if len(signature) <= 9 else signature[:9]


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


def _op_name(func: Any) -> str:
    try:
        return f"{getattr(func, 'namespace', 'aten')}::{func.overloadpacket.__name__}"
    except Exception:
        return str(func)


def _replace(obj: Any, **changes: Any) -> Any:
    import dataclasses

    return dataclasses.replace(obj, **changes)


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
