"""Error metrics of one op output against its float64 oracle.

Pure functions: tensors in (the device output already on the CPU, the oracle in float64), an ``OutputMetrics``
out; neither input is modified.  Elements where both sides are finite give the magnitude metrics; NaN/Inf are
counted on both sides, and an element that is non-finite on the device but finite in the oracle counts as an
overflow.  Integer and bool outputs get a mismatch rate instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Elements smaller than this fraction of the output's largest magnitude are left out of the relative error:
# after cancellation they carry no relative accuracy, in any correct kernel.
REL_MASK_FRACTION = 1e-3

_MANTISSA_BITS = {"float64": 52, "float32": 23, "float16": 10, "bfloat16": 7, "complex128": 52, "complex64": 23}
_MIN_EXPONENT = {
    "float64": -1021,
    "float32": -125,
    "float16": -13,
    "bfloat16": -125,
    "complex128": -1021,
    "complex64": -125,
}


@dataclass(frozen=True)
class OutputMetrics:
    numel: int
    dtype: str
    max_abs: float | None = None
    max_rel: float | None = None
    mean_abs: float | None = None
    rmse: float | None = None
    cosine: float | None = None
    max_ulp: float | None = None
    mean_ulp: float | None = None
    scaled_error: float | None = None
    scale: float | None = None  # max |oracle| over finite elements
    nan_device: int = 0
    inf_device: int = 0
    nan_oracle: int = 0
    inf_oracle: int = 0
    overflow: int = 0
    nonfinite_mismatch: int = 0
    mismatch_rate: float | None = None


def dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def is_discrete(dtype: Any) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


def _eps_and_floor(dtype: Any) -> tuple[float, float]:
    """Machine epsilon of the (real) dtype, and the smallest scale its errors are measured against."""
    import torch

    real = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}
    info = torch.finfo(real.get(dtype, dtype))
    # Values below the dtype's normal range cannot be held by it: an error of one smallest normal number is
    # representation (underflow), not arithmetic, so the scale never drops below tiny(dtype) / eps.
    return float(info.eps), float(info.tiny) / float(info.eps)


def compare(actual: Any, expected: Any, detail: bool = True, actual64: Any = None) -> OutputMetrics:
    """Metrics of ``actual`` (any dtype, CPU) against ``expected`` (the oracle, CPU).

    Shapes must match; the caller checks that.  Discrete dtypes (integers, bool) are compared exactly.  With
    ``detail=False`` a float output whose every element is finite gets only what the verdict needs (max abs, RMSE,
    scaled error) in four passes over the data; relative, ULP and cosine metrics are left out (None).  The
    collector asks for the detail again when the verdict is not a clean pass.  ``actual64``, when given, is
    ``actual`` already converted to float64 (the fast path then subtracts in float64 only: same values, faster
    than a mixed-dtype subtraction).
    """
    import torch

    dtype = dtype_name(actual.dtype)
    numel = int(actual.numel())
    if numel == 0:
        return OutputMetrics(numel=0, dtype=dtype)
    if is_discrete(actual.dtype):
        diff = torch.ne(actual, expected.to(actual.dtype))
        return OutputMetrics(numel=numel, dtype=dtype, mismatch_rate=float(diff.sum().item()) / numel)
    if not detail and not actual.is_complex() and not expected.is_complex():
        fast = _fast(actual, expected, dtype, numel, actual64)
        if fast is not None:
            return fast
    with torch.no_grad():
        a = actual.detach()
        b = expected.detach()
        if a.is_complex() or b.is_complex():
            a = torch.view_as_real(a.to(torch.complex128)) if a.is_complex() else a.to(torch.float64)
            b = torch.view_as_real(b.to(torch.complex128)) if b.is_complex() else b.to(torch.float64)
            if a.shape != b.shape:
                b = b.expand_as(a) if b.dim() == a.dim() else torch.view_as_real(expected.to(torch.complex128))
        a = a.to(torch.float64).reshape(-1)
        b = b.to(torch.float64).reshape(-1)
        fin_a, fin_b = torch.isfinite(a), torch.isfinite(b)
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        inf_a, inf_b = torch.isinf(a), torch.isinf(b)
        overflow = int((~fin_a & fin_b).sum().item())
        # Both non-finite: they agree when both NaN or the same infinity.
        both_nonfinite = ~fin_a & ~fin_b
        agree = (nan_a & nan_b) | (inf_a & inf_b & torch.eq(a, b))
        nonfinite_mismatch = int((both_nonfinite & ~agree).sum().item()) + int((fin_a & ~fin_b).sum().item())
        both = fin_a & fin_b
        counts: dict[str, Any] = {
            "nan_device": int(nan_a.sum().item()),
            "inf_device": int(inf_a.sum().item()),
            "nan_oracle": int(nan_b.sum().item()),
            "inf_oracle": int(inf_b.sum().item()),
            "overflow": overflow,
            "nonfinite_mismatch": nonfinite_mismatch,
        }
        if not bool(both.any()):
            return OutputMetrics(numel=numel, dtype=dtype, **counts)
        if not bool(both.all()):
            a, b = a[both], b[both]
        err = (a - b).abs()
        mag = b.abs()
        scale = float(mag.max().item())
        max_abs = float(err.max().item())
        eps, floor = _eps_and_floor(actual.dtype)
        tiny = float(torch.finfo(torch.float64).tiny)
        scaled = max_abs / (eps * max(scale, floor)) if max_abs > 0 else 0.0
        mask = mag > max(REL_MASK_FRACTION * scale, tiny)
        max_rel = float((err[mask] / mag[mask]).max().item()) if bool(mask.any()) else None
        ulp = _ulp(b, dtype)
        ulps = err / ulp
        na = float(torch.linalg.vector_norm(a).item())
        nb = float(torch.linalg.vector_norm(b).item())
        cosine = float(torch.dot(a, b).item()) / (na * nb) if na > 0 and nb > 0 else float(na == nb)
        return OutputMetrics(
            numel=numel,
            dtype=dtype,
            max_abs=max_abs,
            max_rel=max_rel,
            mean_abs=float(err.mean().item()),
            rmse=math.sqrt(float((err * err).mean().item())),
            cosine=cosine,
            max_ulp=float(ulps.max().item()),
            mean_ulp=float(ulps.mean().item()),
            scaled_error=scaled,
            scale=scale,
            **counts,
        )


def _fast(actual: Any, expected: Any, dtype: str, numel: int, actual64: Any = None) -> OutputMetrics | None:
    """The verdict's metrics in four passes and one host sync; None when something is not finite."""
    import torch

    with torch.no_grad():
        b = expected.detach().to(torch.float64)
        if actual64 is not None and actual64.shape == b.shape:
            diff = torch.sub(actual64, b)
        else:
            diff = torch.sub(actual.detach(), b)  # promotes to float64 in the same pass
        lo, hi = torch.aminmax(diff)
        b_lo, b_hi = torch.aminmax(b)
        stats = torch.stack([lo, hi, b_lo, b_hi, torch.linalg.vector_norm(diff)]).tolist()
    lo_v, hi_v, b_lo_v, b_hi_v, norm = stats
    if not all(math.isfinite(v) for v in stats):
        return None
    max_abs, scale = max(-lo_v, hi_v), max(-b_lo_v, b_hi_v)
    eps, floor = _eps_and_floor(actual.dtype)
    scaled = max_abs / (eps * max(scale, floor)) if max_abs > 0 else 0.0
    return OutputMetrics(
        numel=numel, dtype=dtype, max_abs=max_abs, rmse=norm / math.sqrt(numel), scaled_error=scaled, scale=scale
    )


def _ulp(values: Any, dtype: str) -> Any:
    """Spacing of ``dtype`` at each float64 value (subnormal spacing below the normal range)."""
    import torch

    bits = _MANTISSA_BITS.get(dtype, 23)
    min_exp = _MIN_EXPONENT.get(dtype, -125)
    _, exponent = torch.frexp(values)
    exponent = torch.clamp(exponent, min=min_exp)
    return torch.ldexp(torch.ones_like(values), (exponent - 1 - bits).to(torch.float64))


def to_dict(m: OutputMetrics) -> dict[str, Any]:
    """The metrics as a plain dict (JSON-ready), leaving out what does not apply."""
    out = {k: v for k, v in m.__dict__.items() if v is not None}
    return out
