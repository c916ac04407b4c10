"""One output of a compiled graph against its float64 replay and its eager replay at the same dtype.

Used by the compiled-region checker and by the repro bundles it writes: metrics of both sides against float64
(``analysis.numerics_metrics.compare``) and the ``same()``-style verdict (``analysis.verdict.decide_graph``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from tpudiag.analysis.numerics_metrics import OutputMetrics, compare, dtype_name
from tpudiag.analysis.verdict import GRAPH_TOL, GraphEvidence, Verdict, decide_graph
from tpudiag.model import OpDiff


@dataclass
class OutputCheck:
    """One output of one checked call: metrics and the verdict."""

    verdict: Verdict
    dtype: str
    numel: int
    metrics: OutputMetrics  # compiled vs float64
    ref_metrics: OutputMetrics | None  # eager vs float64
    rmse: float
    ref_rmse: float | None  # None when the output was within the floor (no eager replay made)

    def diff(self, run_id: str, seq: int, index: int, role: str | None = None) -> OpDiff:
        m = self.metrics
        return OpDiff(
            run_id=run_id,
            seq=seq,
            output_index=index,
            verdict=self.verdict.verdict,
            role=role,
            dtype=self.dtype,
            numel=self.numel,
            max_abs=m.max_abs,
            max_rel=m.max_rel,
            mean_abs=m.mean_abs,
            rmse=self.rmse,
            cosine=m.cosine,
            max_ulp=m.max_ulp,
            mean_ulp=m.mean_ulp,
            scaled_error=m.scaled_error,
            ref_scaled_error=self.ref_metrics.scaled_error if self.ref_metrics is not None else None,
            threshold=self.verdict.threshold,
            nan_device=m.nan_device,
            inf_device=m.inf_device,
            nan_oracle=m.nan_oracle,
            inf_oracle=m.inf_oracle,
            mismatch_rate=m.mismatch_rate,
            note=self.verdict.note,
            ref_rmse=self.ref_rmse,
        )


def _rmse(a: torch.Tensor, ref: torch.Tensor) -> float:
    d = a.double() - ref
    finite = torch.isfinite(d)
    if not bool(finite.any()):
        return 0.0
    return float(torch.sqrt(torch.mean(d[finite] ** 2)))


UNDECIDED = "undecided"


def within_floor(compiled: Any, ref: Any) -> bool | None:
    """Whether a floating output is within same()'s absolute floor (tol/10 of its float64 RMS) of float64: it then
    passes whatever eager's error, so the eager replay can be skipped.  None for outputs this cannot tell."""
    if not (isinstance(compiled, torch.Tensor) and isinstance(ref, torch.Tensor)) or compiled.shape != ref.shape:
        return None
    if not compiled.is_floating_point():
        return None
    m = compare(compiled.detach().to("cpu"), ref.detach(), detail=False)
    if m.rmse is None or m.overflow or m.nonfinite_mismatch or m.nan_oracle or m.inf_oracle:
        return None
    rms = float(torch.linalg.vector_norm(ref.detach()) / math.sqrt(max(ref.numel(), 1)))
    tol = GRAPH_TOL.get(m.dtype, GRAPH_TOL["float32"])
    return m.rmse <= tol / 10 * rms


def check_output(compiled: Any, eager: Any, ref: Any, emulated: Any = None) -> OutputCheck | None:
    """Verdict of one output (None for outputs that are not tensors, e.g. SymInts).  ``emulated``: the float64
    replay with reduced-precision matmul inputs; a compiled error that matches it is ``expected_precision``."""
    if not (isinstance(compiled, torch.Tensor) and isinstance(eager, torch.Tensor) and isinstance(ref, torch.Tensor)):
        return None
    ref = ref.detach()
    if compiled.shape != ref.shape:
        return OutputCheck(
            Verdict("fail", None, f"shape {list(compiled.shape)} vs {list(ref.shape)}"),
            dtype_name(compiled.dtype),
            compiled.numel(),
            compare(ref, ref),
            None,
            math.nan,
            math.nan,
        )
    c = compiled.detach().to("cpu")
    e = eager.detach().to("cpu")
    if not (c.is_floating_point() or c.is_complex()):
        m = compare(c, ref)
        mr = compare(e, ref)
        v = Verdict(
            "fail" if (m.mismatch_rate or 0) > 0 else "pass",
            0.0,
            f"{m.mismatch_rate:.3%} of elements differ" if m.mismatch_rate else None,
        )
        return OutputCheck(v, m.dtype, m.numel, m, mr, 0.0, 0.0)
    # Fast metrics first (max abs, RMSE, scaled error: what the verdict needs); the full set only for a finding.
    m = compare(c, ref, detail=False)
    mr = compare(e, ref, detail=False)
    rms = float(torch.linalg.vector_norm(ref) / math.sqrt(max(ref.numel(), 1))) if m.nan_oracle == 0 else 0.0
    if m.nan_oracle or m.inf_oracle:
        finite = torch.isfinite(ref)
        rms = float(torch.sqrt(torch.mean(ref[finite] ** 2))) if bool(finite.any()) else 0.0
    diff_ref = (c.double() - e.double()).abs()
    if not bool(torch.isfinite(diff_ref).all()):
        diff_ref = diff_ref[torch.isfinite(diff_ref)]
    ev = GraphEvidence(
        dtype=m.dtype,
        numel=m.numel,
        rmse=m.rmse if m.rmse is not None else _rmse(c, ref),
        ref_rmse=mr.rmse if mr.rmse is not None else _rmse(e, ref),
        max_diff_ref=float(diff_ref.max()) if diff_ref.numel() else 0.0,
        scale=m.scale if m.scale is not None else 0.0,
        rms=rms,
        overflow=m.overflow if not mr.overflow else 0,
        nonfinite_mismatch=m.nonfinite_mismatch if not mr.nonfinite_mismatch else 0,
        emulated_rmse=_rmse(emulated, ref) if isinstance(emulated, torch.Tensor) else None,
    )
    verdict = decide_graph(ev)
    if verdict.verdict != "pass":
        m = compare(c, ref)
    return OutputCheck(verdict, m.dtype, m.numel, m, mr, ev.rmse, ev.ref_rmse)


def floor_check(compiled: Any, ref: Any) -> OutputCheck:
    """The pass of an output within the floor (see ``within_floor``), with its metrics against float64."""
    c = compiled.detach().to("cpu")
    m = compare(c, ref.detach(), detail=False)
    note = "within tol/10 of the output's RMS of float64 (no eager reference needed)"
    return OutputCheck(Verdict("pass", None, note), m.dtype, m.numel, m, None, m.rmse or 0.0, None)
