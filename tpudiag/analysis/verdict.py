"""The numerics verdict: is an op's output wrong, or just as (in)exact as a correct kernel at its dtype?

Pure functions over plain values (no torch).  The error measure is the *scaled error*: the largest absolute error
of the output divided by (machine epsilon of the output dtype x the largest magnitude of the float64 oracle
output).  It is insensitive to cancellation in single elements, which makes per-element relative or ULP errors cry
wolf on correct reductions (DESIGN §4.2): on GPT-2 fp32 every correct op scores <= 4, a 3e-3 relative fault scores
25,000.

The threshold depends on what the op does: elementwise ops are allowed a few ulps, reductions and matmuls grow
with the square root of the reduction length (the usual probabilistic bound of floating-point summation).  When
the device is not the CPU, the CPU's own error at the device dtype is a second yardstick: an op at most ``k`` times
worse than the CPU kernel (k = 2 for fp32, 3 for 16-bit floats, as in dynamo's fp64 rule) is never flagged.

Here: the rules (thresholds, ``decide``, roles, the compiled-graph rule ``decide_graph``) and the dtype facts they
use (eps, the working dtype).  Which kind an op is (elementwise, reduction, matmul...) is in ``op_kinds``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

VERDICTS = ("pass", "fail", "overflow", "scaled_overflow", "expected_precision", "skip")
DIVERGENT = ("fail", "overflow")

# Machine epsilon per dtype name (torch.finfo(dt).eps), written out so this module needs no torch.
EPS = {
    "float64": 2.220446049250313e-16,
    "float32": 1.1920928955078125e-07,
    "float16": 0.0009765625,
    "bfloat16": 0.0078125,
    "complex128": 2.220446049250313e-16,
    "complex64": 1.1920928955078125e-07,
    "complex32": 0.0009765625,
    "float8_e4m3fn": 0.125,
    "float8_e5m2": 0.25,
}

# Allowed scaled error, in eps units of the output dtype.
ELEMENTWISE_ULPS = 32.0
# Special functions (gamma family, Bessel, zeta, erfinv...) are accurate to tens of ulps in float32, not a few;
# 512 eps is still 6e-5 relative in fp32, far below a fault of parts per thousand.
SPECIAL_ULPS = 512.0
REDUCTION_BASE_ULPS = 32.0
REDUCTION_SQRT_FACTOR = 4.0
# Device k x CPU-same-dtype error still passes (dynamo's fp64 rule: 2 for fp32, 3 for 16-bit floats).
CPU_RATIO = {"float32": 2.0, "complex64": 2.0, "float16": 3.0, "bfloat16": 3.0}
# A matmul finding "matches" an emulated reduced-precision matmul when its error is at most this multiple of it.
PRECISION_MATCH_FACTOR = 4.0


def eps_of(dtype: str) -> float:
    return EPS.get(dtype.removeprefix("torch."), EPS["float32"])


_REAL_FLOATS = ("float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2")


def working_dtype(output: str, inputs: Iterable[str]) -> str:
    """The precision an output is judged at: its own dtype, or its least precise floating input's when coarser.

    A mixed-precision kernel works at its inputs' precision: under bf16 autocast a layer norm's backward takes bf16
    activations and gradients with float32 weights and writes float32 weight and bias gradients, rounded as bf16
    work is.  Judged at float32 eps those correct gradients read as 2e4 eps divergences (issue 19, an Accelerator
    loop with bf16 autocast on the CPU).
    """
    if output not in _REAL_FLOATS:
        return output
    worst = output
    for d in inputs:
        if d in _REAL_FLOATS and EPS[d] > EPS[worst]:
            worst = d
    return worst


def threshold(kind: str, dtype: str, reduction_len: int = 1) -> float:
    """Allowed scaled error (eps units of ``dtype``) for a correct kernel of this kind."""
    if kind in ("elementwise", "copy", "discrete"):
        return ELEMENTWISE_ULPS
    if kind == "special":
        return SPECIAL_ULPS
    n = max(1, int(reduction_len))
    return REDUCTION_BASE_ULPS + REDUCTION_SQRT_FACTOR * math.sqrt(n)


@dataclass(frozen=True)
class Evidence:
    """What the verdict looks at for one output (built from the metrics)."""

    dtype: str
    kind: str
    scaled_error: float | None = None  # device vs oracle, eps units
    ref_scaled_error: float | None = None  # CPU at the device dtype vs oracle (None on CPU-only runs)
    overflow: int = 0  # elements non-finite on the device, finite in the oracle
    nonfinite_mismatch: int = 0  # other disagreements about NaN/Inf
    mismatch_rate: float | None = None  # discrete outputs
    reduction_len: int = 1
    emulated_scaled_error: float | None = None  # emulated reduced-precision matmul vs oracle


@dataclass(frozen=True)
class Verdict:
    verdict: str
    threshold: float | None
    note: str | None = None


def decide(ev: Evidence) -> Verdict:
    """The verdict for one output."""
    if ev.overflow:
        return Verdict("overflow", None, f"{ev.overflow} element(s) non-finite on the device, finite in float64")
    if ev.mismatch_rate is not None:
        if ev.mismatch_rate > 0:
            return Verdict("fail", 0.0, f"{ev.mismatch_rate:.3%} of elements differ")
        return Verdict("pass", 0.0)
    if ev.nonfinite_mismatch:
        return Verdict("fail", None, f"{ev.nonfinite_mismatch} element(s) disagree about NaN/Inf")
    limit = threshold(ev.kind, ev.dtype, ev.reduction_len)
    err = ev.scaled_error or 0.0
    if err <= limit:
        return Verdict("pass", limit)
    if ev.ref_scaled_error is not None:
        allowed = CPU_RATIO.get(ev.dtype, 2.0) * ev.ref_scaled_error
        if err <= allowed:
            return Verdict("pass", max(limit, allowed), "as accurate as the CPU kernel at this dtype")
    if ev.emulated_scaled_error is not None and err <= PRECISION_MATCH_FACTOR * max(ev.emulated_scaled_error, limit):
        return Verdict(
            "expected_precision", limit, "matches a reduced-precision (bf16/TF32-input) matmul: expected precision loss"
        )
    return Verdict("fail", limit, f"{err:.3g} eps > {limit:.3g}")


def is_divergent(verdict: str) -> bool:
    return verdict in DIVERGENT


def role(local_verdict: str, propagated_divergent: bool) -> str | None:
    """Originator: the op itself is wrong.  Propagator: correct from its inputs, but its inputs were already off."""
    if local_verdict in DIVERGENT:
        return "originator"
    if propagated_divergent:
        return "propagator"
    return None


# -- compiled graphs: the rule torch._dynamo.utils.same applies against a float64 reference -----------------------
# Tolerance by output dtype (same()'s default is 1e-4; reduced-precision outputs get the looser tolerances the
# PyTorch accuracy tooling uses for them).
GRAPH_TOL = {"float64": 1e-7, "float32": 1e-4, "float16": 1e-3, "bfloat16": 1e-2}


def graph_multiplier(dtype: str, numel: int) -> float:
    """How much worse than eager (at the same dtype) a compiled output may be against float64: same()'s k."""
    if dtype in ("float16", "bfloat16") or numel < 1000:
        return 3.0
    return 2.0


@dataclass(frozen=True)
class GraphEvidence:
    """One output of a compiled graph: compiled and eager (same dtype) against the float64 replay of the graph."""

    dtype: str
    numel: int
    rmse: float  # compiled vs float64
    ref_rmse: float  # eager at the output dtype vs float64
    max_diff_ref: float  # max |compiled - eager|
    scale: float  # max |float64| (finite elements)
    rms: float  # root mean square of the float64 output
    overflow: int = 0
    nonfinite_mismatch: int = 0
    emulated_rmse: float | None = None  # eager with reduced-precision (bf16/TF32-input) matmuls vs float64


def decide_graph(ev: GraphEvidence) -> Verdict:
    """The verdict for one compiled-graph output (torch._dynamo.utils.same against float64, scale-relative).

    Pass when compiled and eager agree within ``tol`` of the output's scale; otherwise pass iff
    ``rmse(compiled) <= k * rmse(eager) + tol/10 * rms(float64)``.  same() uses absolute tolerances; scaling them by
    the output's magnitude keeps the rule the same for outputs of any size.
    """
    if ev.overflow:
        return Verdict(
            "overflow", None, f"{ev.overflow} element(s) non-finite in the compiled output, finite in float64"
        )
    if ev.nonfinite_mismatch:
        return Verdict("fail", None, f"{ev.nonfinite_mismatch} element(s) disagree about NaN/Inf")
    tol = GRAPH_TOL.get(ev.dtype, GRAPH_TOL["float32"])
    k = graph_multiplier(ev.dtype, ev.numel)
    allowed = k * ev.ref_rmse + tol / 10 * ev.rms
    rmses = f"RMSE (compiled-fp64) {ev.rmse:.3g}, (eager-fp64) {ev.ref_rmse:.3g}"
    if ev.max_diff_ref <= tol * ev.scale:
        return Verdict("pass", allowed, "compiled matches eager within tolerance")
    if ev.rmse <= allowed:
        return Verdict("pass", allowed, rmses)
    if ev.emulated_rmse is not None and ev.rmse <= PRECISION_MATCH_FACTOR * max(ev.emulated_rmse, allowed):
        return Verdict("expected_precision", allowed, f"{rmses}: matches reduced-precision matmuls")
    return Verdict("fail", allowed, f"{rmses} > allowed {allowed:.3g} (k={k:g})")
