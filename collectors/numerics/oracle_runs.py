"""The oracle's re-runs of one call (float64, absolute-value magnitudes, emulated reduced-precision matmuls) and
the ``OpDiff`` row of one output.  A mixin of ``NumericsMode``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from tpudiag.analysis.numerics_metrics import OutputMetrics, compare, dtype_name
from tpudiag.analysis.verdict import Verdict
from tpudiag.model import OpDiff
from tpudiag.oracle import ops as oracle
from tpudiag.oracle.copies import Float64Copies
from tpudiag.oracle.ops import OpPlan
from tpudiag.tool_range import tool_range

if TYPE_CHECKING:
    from tpudiag.collectors.numerics.context import Context


class _OracleFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class OracleRuns:
    ctx: Context
    autocast_seen: set[str]
    _precision_cache: dict[tuple[tuple[str, str], ...], str]

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


# The checker's own work runs inside this profiler range, so a trace captured beside it can tell the script's ops
# from the oracle's (tpudiag.traces.kineto marks everything under it as tool overhead, never as a slow op).
TOOL_RANGE = "tpudiag::numerics"


def _tool_range() -> Any:
    """The tool range while a profiler records (a trace is being captured), with none of the checker's ops
    recorded beneath it; else nothing to pay for."""
    return tool_range(TOOL_RANGE)


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
