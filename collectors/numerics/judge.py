"""Judging one checked call's outputs: the float64 oracle (and, off the CPU, the device-dtype reference), the
verdict per output, cancellation and emulated-precision allowances, the shadow stream's propagation test.

A mixin of ``NumericsMode`` (it reads the mode's context, copy cache and shadow stream)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from tpudiag import internal_errors
from tpudiag.analysis.numerics_metrics import compare, dtype_name, is_discrete
from tpudiag.analysis.verdict import DIVERGENT, Evidence, Verdict, decide, eps_of, role, working_dtype
from tpudiag.collectors.numerics.oracle_runs import OracleRuns, _dense_of, _OracleFailed, _strided, _tool_range
from tpudiag.model import OpDiff
from tpudiag.oracle import ops as oracle
from tpudiag.oracle.ops import OpPlan

if TYPE_CHECKING:
    from tpudiag.collectors.numerics.context import Context
    from tpudiag.collectors.numerics.grad_scaler import ScalerWatch
    from tpudiag.collectors.numerics.shadow import ShadowStream
    from tpudiag.oracle.copies import Float64Copies

# Kinds whose outputs combine terms, so cancellation can make a correct result tiny against its rounding error.
CANCELLING_KINDS = (
    "reduction",
    "matmul",
    "normalization",
    "elementwise",
    "special",
)  # elements per op (inputs and outputs): larger calls are skipped as "size_cap"


class OutputJudge(OracleRuns):
    ctx: Context
    copies: Float64Copies
    shadow: ShadowStream
    scalers: ScalerWatch

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
        shadow_subst: dict[int, torch.Tensor],
        fresh_ids: set[int],
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
                shadow_subst,
                fresh_ids,
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
            if verdict.verdict == "overflow" and torch._C._current_graph_task_id() >= 0 and self.scalers.scaling():
                # A GradScaler's scaled gradients past the dtype's range: the scaler's own check skips this step
                # and lowers its scale (grad_scaler.py).  Not divergent, and nothing downstream is measured from it.
                verdict = Verdict(
                    "scaled_overflow",
                    None,
                    f"{m.overflow} element(s) of GradScaler-scaled gradients past the {m.dtype} range (the scaler "
                    "skips the optimizer step and lowers its scale)",
                )
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
