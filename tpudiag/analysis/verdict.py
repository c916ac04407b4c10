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
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

VERDICTS = ("pass", "fail", "overflow", "expected_precision", "skip")
DIVERGENT = ("fail", "overflow")
KINDS = ("elementwise", "special", "reduction", "matmul", "normalization", "discrete", "copy")

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

_MATMUL = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "matmul",
    "dot",
    "vdot",
    "mv",
    "addmv",
    "addbmm",
    "addr",
    "linear",
    "convolution",
    "_convolution",
    "convolution_backward",
    "conv1d",
    "conv2d",
    "conv3d",
    "cudnn_convolution",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_attention_math",
    "tensordot",
    "einsum",
    "_int_mm",
    "_weight_int8pack_mm",
    "mkldnn_convolution",
    "slow_conv2d_forward",
    "slow_conv_transpose2d",
    "convolution_overrideable",
}
_NORMALIZATION = {
    "native_layer_norm",
    "native_layer_norm_backward",
    "native_batch_norm",
    "native_batch_norm_backward",
    "_native_batch_norm_legit",
    "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional",
    "native_group_norm",
    "native_group_norm_backward",
    "_fused_rms_norm",
    "_fused_rms_norm_backward",
    "_softmax",
    "_log_softmax",
    "_softmax_backward_data",
    "_log_softmax_backward_data",
    "softmax",
    "log_softmax",
    "batch_norm_backward",
    "cudnn_batch_norm",
    "_batch_norm_with_update",
    "_batch_norm_no_update",
    "renorm",
    "normalize",
}
_REDUCTION_NAMES = {
    "sum",
    "mean",
    "nansum",
    "nanmean",
    "prod",
    "var",
    "std",
    "norm",
    "dist",
    "trace",
    "det",
    "logdet",
    "slogdet",
    "lu",
    "mode",
    "median",
    "nanmedian",
    "kthvalue",
    "std_mean",
    "var_mean",
    "amax",
    "amin",
    "aminmax",
    "inverse",
    "cholesky",
    "kron",
    "histc",
    "bincount",
    "pdist",
    "_pdist_forward",
    "stft",
    "istft",
    "polar",
    "cdist",
    "_cdist_forward",
    "cosine_similarity",
    "logsumexp",
    "cumsum",
    "cumprod",
    "logcumsumexp",
    "_logcumsumexp",
    "index_add",
    "scatter_add",
    "scatter_reduce",
    "index_reduce",
    "_foreach_norm",
    "renorm",
    "col2im",
    "im2col",
    "pinverse",
    "matrix_exp",
    "matrix_power",
    "triangular_solve",
    "cholesky_solve",
    "cholesky_inverse",
}
_REDUCTION_PREFIXES = (
    "linalg_",
    "_linalg_",
    "fft_",
    "_fft_",
    "avg_pool",
    "adaptive_avg_pool",
    "_adaptive_avg_pool",
    "max_pool",
    "adaptive_max_pool",
    "fractional_max_pool",
    "upsample",
    "_upsample",
    "grid_sampler",
    "embedding_dense_backward",
    "embedding_backward",
    "_embedding_bag",
    "nll_loss",
    "cross_entropy",
    "binary_cross_entropy",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "kl_div",
    "ctc_loss",
    "_ctc_loss",
    "multilabel_margin_loss",
    "multi_margin_loss",
    "soft_margin_loss",
    "hinge_embedding_loss",
    "margin_ranking_loss",
    "poisson_nll_loss",
    "segment_reduce",
    "_segment_reduce",
    "reflection_pad",
    "replication_pad",
    "special_logsumexp",
    "_cummax",
    "_cummin",
    "_sparse",
    "sparse_",
)
# Backward kernels of elementwise functions are elementwise themselves.
_ELEMENTWISE_BACKWARD = {
    "tanh",
    "sigmoid",
    "gelu",
    "silu",
    "mish",
    "threshold",
    "hardtanh",
    "hardsigmoid",
    "hardswish",
    "leaky_relu",
    "elu",
    "softplus",
    "log_sigmoid",
    "rrelu_with_noise",
    "hardshrink",
    "softshrink",
    "logit",
    "_prelu_kernel",
    "glu",
}
_SPECIAL_PREFIXES = (
    "polygamma",
    "digamma",
    "lgamma",
    "mvlgamma",
    "zeta",
    "igamma",
    "igammac",
    "erfinv",
    "i0",
    "i1",
    "bessel_",
    "modified_bessel_",
    "scaled_modified_bessel_",
    "spherical_bessel_",
    "special_",
    "chebyshev_",
    "hermite_",
    "laguerre_",
    "legendre_",
    "shifted_chebyshev_",
    "airy_",
    "ndtri",
    "log_ndtr",
    "erfcx",
    "entr",
    "sinc",
)
_DISCRETE = {
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "isnan",
    "isinf",
    "isfinite",
    "isposinf",
    "isneginf",
    "logical_and",
    "logical_or",
    "logical_xor",
    "logical_not",
    "argmax",
    "argmin",
    "argsort",
    "nonzero",
    "sign",
    "signbit",
    "bitwise_and",
    "bitwise_or",
    "bitwise_xor",
    "bitwise_not",
    "searchsorted",
    "bucketize",
    "any",
    "all",
    "isin",
    "equal",
    "is_nonzero",
    "count_nonzero",
    "unique",
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
}
_COPY = {
    "clone",
    "copy",
    "copy_",
    "_to_copy",
    "_copy_from",
    "_copy_from_and_resize",
    "lift_fresh_copy",
    "contiguous",
    "_unsafe_view",
    "view_copy",
    "transpose_copy",
    "permute_copy",
    "expand_copy",
    "index_select",
    "gather",
    "cat",
    "stack",
    "index",
    "take",
    "masked_select",
    "repeat",
    "flip",
    "roll",
    "constant_pad_nd",
    "fill",
    "fill_",
    "zero_",
    "zeros_like",
    "ones_like",
    "full_like",
    "where",
    "masked_fill",
    "masked_fill_",
    "index_put",
    "index_put_",
    "_index_put_impl_",
    "scatter",
    "scatter_",
    "select_scatter",
    "slice_scatter",
    "diagonal_scatter",
    "as_strided_scatter",
    "tril",
    "triu",
    "_local_scalar_dense",
    "embedding",
    "split_with_sizes_copy",
    "unbind_copy",
    "narrow_copy",
    "t_copy",
    "tile",
    "_reshape_copy",
    "pixel_shuffle",
    "pixel_unshuffle",
    "channel_shuffle",
}


def base_name(op: str) -> str:
    """``aten::add_.Tensor`` / ``aten.add_.Tensor`` / ``add_`` -> ``add_``."""
    name = op.replace("::", ".")
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims", "torch_tpu", "tpu") else parts[0]


def op_kind(op: str) -> str:
    """The kind of arithmetic an op does, which sets how much rounding error a correct kernel may show."""
    name = base_name(op)
    bare = name.rstrip("_") if not name.startswith("_") else name
    for candidate in (name, bare, name.removesuffix("_out")):
        if candidate in _MATMUL:
            return "matmul"
        if candidate in _NORMALIZATION:
            return "normalization"
        if candidate in _DISCRETE:
            return "discrete"
        if candidate in _COPY:
            return "copy"
    if name.startswith(_SPECIAL_PREFIXES) and "backward" not in name:
        return "special"
    if name.startswith(("_foreach_", "_fused_")) and "norm" not in name:
        return "elementwise"
    if {name, bare, name.removesuffix("_out")} & _REDUCTION_NAMES or name.startswith(_REDUCTION_PREFIXES):
        return "reduction"
    if name.endswith("_backward") and name.removesuffix("_backward") in _ELEMENTWISE_BACKWARD:
        return "elementwise"
    if "backward" in name:
        # Most other backward kernels reduce over broadcast, pooled or normalised dimensions.
        return "reduction"
    return "elementwise"


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
