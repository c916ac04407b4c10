"""The op-kind tables: which kind of arithmetic an aten op does (``op_kind``), which sets how much rounding error a
correct kernel of it may show (``verdict.threshold``).

Pure functions and name tables (no torch): matmuls and convolutions, normalizations and softmaxes, reductions
(by name and by prefix), elementwise backward kernels, special functions; the exact kinds (discrete, copy) are in
``exact_ops``.  ``base_name`` strips an op's namespace and overload.
"""

from __future__ import annotations

from tpudiag.analysis.exact_ops import COPY, DISCRETE

KINDS = ("elementwise", "special", "reduction", "matmul", "normalization", "discrete", "copy")

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
        if candidate in DISCRETE:
            return "discrete"
        if candidate in COPY:
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
