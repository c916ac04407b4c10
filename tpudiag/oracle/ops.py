"""The CPU oracle: re-run one aten op on the CPU from copies of its own inputs, in float64 or another dtype.

Everything here works on copies: a user's tensor is read (``.to("cpu", copy=True)``) but never written.  What an
op is and how it may be checked (view, random, uninitialised, non-unique outputs, which arguments it mutates) is
read once per overload from its schema and tags and cached in an ``OpPlan``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tpudiag.analysis.op_kinds import op_kind
from tpudiag.oracle.copies import Float64Copies

UNINITIALIZED = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "empty_permuted",
    "resize_",
    "resize_as_",
    "set_",
    "_resize_output_",
    "_empty_affine_quantized",
    "_empty_per_channel_affine_quantized",
}
# Ops without arithmetic worth checking (metadata, bookkeeping, stream sync).
NO_ARITHMETIC = {
    "detach",
    "detach_",
    "lift_fresh",
    "alias",
    "record_stream",
    "_has_compatible_shallow_copy_type",
    "is_same_size",
    "_local_scalar_dense",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "_assert_async",
    "_assert_tensor_metadata",
    "_functional_assert_async",
    "_print",
    "is_pinned",
    "_nested_tensor_size",
    "_version",
    "retain_grad",
    "requires_grad_",
    "_make_dep_token",
    "zeros",
    "ones",
    "_foreach_zero_",
    "zero_",
    "fill_",
    "fill",
    "full",
    "full_like",
    "zeros_like",
    "ones_like",
    "scalar_tensor",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "tensor",
    "_to_dense",
    "to_dense",
    "_conj",
    "_neg_view",
    "resolve_conj",
    "resolve_neg",
    "_conj_physical",
    "conj_physical",
}
# Decompositions whose outputs are defined only up to sign, phase or order: every output left out ...
NONUNIQUE_OPS = {
    "linalg_eig",
    "_linalg_eig",
    "eig",
    "linalg_eigvals",
    "_linalg_svd_vectors",
    "linalg_qr",
    "geqrf",
    "orgqr",
    "ormqr",
    "linalg_lu",
    "linalg_lu_factor_ex",
    "lu_unpack",
    "_lu_with_info",
    "linalg_householder_product",
    "linalg_ldl_factor_ex",
    "linalg_ldl_solve",
    "lobpcg",
    "pca_lowrank",
    "svd_lowrank",
}
# ... or only some outputs (index: eigen/singular vectors).
NONUNIQUE_OUTPUTS = {
    "_linalg_eigh": {1},
    "linalg_eigh": {1},
    "_linalg_svd": {0, 2},
    "linalg_svd": {0, 2},
    "svd": {0, 2},
    "symeig": {1},
}
# Index outputs that are ambiguous under ties (the values output is compared).
TIE_OUTPUTS = {
    "sort": {1},
    "topk": {1},
    "kthvalue": {1},
    "mode": {1},
    "median": {1},
    "nanmedian": {1},
    "max": {1},
    "min": {1},
    "cummax": {1},
    "cummin": {1},
    "argsort": {0},
    "argmax": {0},
    "argmin": {0},
    "msort": set(),
    "max_pool2d_with_indices": {1},
    "max_pool3d_with_indices": {1},
    "adaptive_max_pool2d": {1},
    "adaptive_max_pool3d": {1},
    "fractional_max_pool2d": {1},
    "fractional_max_pool3d": {1},
    "_unique2": {1, 2},
    "unique_dim": {1, 2},
    "unique_consecutive": {1, 2},
}
# Ops whose default tolerance (rank cutoff) depends on the input dtype: float64 changes their meaning.
DTYPE_TOLERANCE_OPS = {"linalg_pinv", "pinverse", "linalg_matrix_rank", "matrix_rank", "linalg_lstsq"}
# Outputs that are internal workspaces kept for backward (with sentinel values), not results.
WORKSPACE_OUTPUTS = {"_ctc_loss": {1}}
# Ops whose result depends on the storage layout of their input (as_strided reads the storage, not the view).
STORAGE_OPS = {"as_strided", "as_strided_", "as_strided_copy", "as_strided_scatter"}


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """pytree's tree_map for what aten ops take and return (tuples, lists, dicts): several times faster."""
    if isinstance(obj, (tuple, list)):
        mapped = [tree_map(fn, x) for x in obj]
        return tuple(mapped) if isinstance(obj, tuple) else mapped
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    return fn(obj)


def tree_flatten(obj: Any) -> tuple[list[Any], None]:
    """The leaves of nested tuples, lists and dicts, in order.

    A loop, not a recursive inner function: such a function sits in a reference cycle with its own closure, so each
    call's list (an op's arguments and outputs) lived until the cyclic garbage collector ran, keeping the script's
    tensors alive past their last use (+90 MB a checked 2M-element sort, host or device memory alike).
    """
    out: list[Any] = []
    stack: list[Any] = [obj]
    while stack:
        x = stack.pop()
        if isinstance(x, (tuple, list)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
        else:
            out.append(x)
    return out, None


@dataclass(frozen=True)
class OpPlan:
    name: str  # "aten::tanh"
    overload: str  # "default"
    kind: str
    skip: str | None  # a static skip reason, or None
    is_view: bool
    mutates: bool
    written: tuple[int | str, ...] = ()  # positions / keyword names of written arguments
    skip_outputs: dict[int, str] = field(default_factory=dict)  # output index -> reason


_PLANS: dict[int, tuple[Any, OpPlan]] = {}


def plan_for(func: Any) -> OpPlan:
    """The plan of an op overload, read from its schema once (cached by identity: overloads live forever)."""
    hit = _PLANS.get(id(func))
    if hit is not None and hit[0] is func:
        return hit[1]
    plan = _make_plan(func)
    _PLANS[id(func)] = (func, plan)
    return plan


def _make_plan(func: Any) -> OpPlan:
    schema = func._schema
    packet = func.overloadpacket.__name__ if hasattr(func, "overloadpacket") else str(func)
    namespace = getattr(func, "namespace", "aten")
    name = f"{namespace}::{packet}"
    overload = getattr(func, "_overloadname", "default")
    written: list[int | str] = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            written.append(arg.name if arg.kwarg_only else i)
    returns = list(schema.returns)
    is_view = bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)
    tags = set(getattr(func, "tags", ()))
    skip: str | None = None
    skip_outputs: dict[int, str] = {}
    base = packet
    if torch.Tag.nondeterministic_seeded in tags:
        skip = "random"
    elif base in UNINITIALIZED:
        skip = "uninitialized"
    elif base in NONUNIQUE_OPS:
        skip = "nonunique"
    elif base in DTYPE_TOLERANCE_OPS:
        skip = "dtype_tolerance"
    elif is_view and base not in STORAGE_OPS:
        skip = "view"
    elif base in NO_ARITHMETIC:
        skip = "no_arithmetic"
    elif namespace not in ("aten", "prims"):
        skip = "not_aten"
    if base in NONUNIQUE_OUTPUTS:
        skip_outputs.update({i: "nonunique" for i in NONUNIQUE_OUTPUTS[base]})
    if base in WORKSPACE_OUTPUTS:
        skip_outputs.update({i: "workspace" for i in WORKSPACE_OUTPUTS[base]})
    if base in TIE_OUTPUTS:
        skip_outputs.update({i: "ties" for i in TIE_OUTPUTS[base]})
    return OpPlan(name, overload, op_kind(name), skip, is_view, bool(written), tuple(written), skip_outputs)


def float64_of(dtype: torch.dtype) -> torch.dtype:
    if dtype.is_complex:
        return torch.complex128
    if dtype.is_floating_point:
        return torch.float64
    return dtype


def _convert_kwargs(kwargs: dict[str, Any], dtype_fn: Callable[[torch.dtype], torch.dtype]) -> dict[str, Any]:
    out = dict(kwargs)
    for key in ("dtype", "out_dtype"):
        value = out.get(key)
        if isinstance(value, torch.dtype):
            out[key] = dtype_fn(value)
    for key in ("device",):
        if key in out and out[key] is not None:
            out[key] = torch.device("cpu")
    if "pin_memory" in out:
        out["pin_memory"] = None
    return out


def convert(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    dtype_fn: Callable[[torch.dtype], torch.dtype],
    substitute: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    copies: Float64Copies | None = None,
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """CPU copies of every tensor argument, floating ones converted with ``dtype_fn``.

    ``substitute`` may return a replacement (a shadow value) for a tensor; it is copied the same way.  With
    ``copies`` (float64 conversion of an op that writes none of these arguments), a tensor's float64 copy is
    taken from / kept in that cache instead of being made again.
    """

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            src = substitute(x) if substitute is not None else None
            if src is None and copies is not None:
                kept = copies.get(x)
                if kept is not None:
                    return kept
                copy = x.detach().to("cpu", dtype_fn(x.dtype), copy=True)
                copies.put(x, copy)
                return copy
            src = x if src is None else src
            if src.shape != x.shape:
                src = x
            return src.detach().to("cpu", dtype_fn(x.dtype), copy=True)
        if isinstance(x, torch.dtype):
            return x
        if isinstance(x, torch.device):
            return torch.device("cpu")
        return x

    new_args = tree_map(one, args)
    new_kwargs = _convert_kwargs(tree_map(one, kwargs), dtype_fn)
    positional = list(new_args)
    # A positional dtype argument (e.g. sum(x, dim, keepdim, dtype) called positionally) is rare after dispatch;
    # kwargs cover the common schemas.
    return tuple(positional), new_kwargs


def storage_faithful(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CPU copy of ``x`` with the same storage layout (size, stride, offset over a copy of the whole storage).

    as_strided reads the underlying storage, so a contiguous copy of the view would give it different data.
    """
    nbytes = x.untyped_storage().nbytes()
    count = nbytes // x.element_size()
    base = torch.empty(0, dtype=x.dtype, device=x.device)
    base.set_(x.untyped_storage(), 0, (count,), (1,))
    flat = base.detach().to("cpu", dtype, copy=True)
    return flat.as_strided(x.size(), x.stride(), x.storage_offset())


def convert_storage_faithful(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype_fn: Callable[[torch.dtype], torch.dtype]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    new_args = list(args)
    if new_args and isinstance(new_args[0], torch.Tensor):
        first = new_args[0]
        rest_args, rest_kwargs = convert(tuple(new_args[1:]), kwargs, dtype_fn)
        return (storage_faithful(first, dtype_fn(first.dtype)), *rest_args), rest_kwargs
    return convert(args, kwargs, dtype_fn)


def written_values(plan: OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    vals: list[Any] = []
    for w in plan.written:
        if isinstance(w, int):
            if w < len(args):
                vals.append(args[w])
        elif w in kwargs:
            vals.append(kwargs[w])
    return vals


def targets(plan: OpPlan, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> list[Any]:
    """The values to compare: the op's returned tensors/scalars, or the arguments it wrote when it returns nothing."""
    leaves, _ = tree_flatten(out)
    leaves = [x for x in leaves if isinstance(x, (torch.Tensor, bool, int, float, complex))]
    if leaves or not plan.mutates:
        return leaves
    written, _ = tree_flatten(written_values(plan, args, kwargs))
    return [x for x in written if isinstance(x, torch.Tensor)]


def as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    return torch.tensor(value)


def tensors_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensor arguments in order (aten schemas nest at most a list of tensors inside the arguments)."""
    out: list[torch.Tensor] = []
    for group in (args, kwargs.values()) if kwargs else (args,):
        for x in group:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, (list, tuple)):
                for y in x:
                    if isinstance(y, torch.Tensor):
                        out.append(y)
                    elif isinstance(y, (list, tuple, dict)):
                        out.extend(t for t in tree_flatten(y)[0] if isinstance(t, torch.Tensor))
            elif isinstance(x, dict):
                out.extend(t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor))
    return out


def input_problem(tensors: list[torch.Tensor]) -> str | None:
    """Why these inputs cannot be copied to the CPU honestly, or None."""
    for t in tensors:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            return "tensor_subclass"
        if t.device.type == "meta":
            return "meta"
        if t.layout != torch.strided:
            return "layout"
        if t.is_quantized:
            return "quantized"
    return None


def reduction_len(plan: OpPlan, inputs: list[torch.Tensor], outputs: list[Any]) -> int:
    """How many terms feed one output element (sets the rounding budget of reductions and matmuls)."""
    if plan.kind not in ("reduction", "matmul", "normalization"):
        return 1
    biggest_in = max((t.numel() for t in inputs), default=1)
    out_numel = max((t.numel() for t in outputs if isinstance(t, torch.Tensor)), default=1)
    if plan.kind == "matmul" and len(inputs) >= 2:
        # Inner dimension: the last dimension of the first matrix operand with >= 2 dims.
        mats = [t for t in inputs if t.dim() >= 2]
        if mats:
            return max(int(mats[0].shape[-1]), int(mats[-1].shape[-2]) if mats[-1].dim() >= 2 else 1)
    return max(1, biggest_in // max(1, out_numel))


def round_to_tf32(x: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to TF32's 10-bit mantissa (round to nearest)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    rounded = torch.bitwise_and(bits + 0x1000, ~0x1FFF)
    return rounded.view(torch.float32)


def emulation_casts(kinds: list[str]) -> list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    casts: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = []
    for kind in kinds:
        if kind == "bf16":
            casts.append(("bf16", lambda t: t.to(torch.bfloat16).to(torch.float64)))
        elif kind == "tf32":
            casts.append(("tf32", lambda t: round_to_tf32(t).to(torch.float64)))
    return casts


def emulate_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any], cast: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Float32 tensor inputs rounded as a reduced-precision matmul unit would, then held in float64."""

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype == torch.float32:
            return cast(x.detach().cpu())
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", float64_of(x.dtype), copy=True)
        return x

    return tree_map(one, args), _convert_kwargs(tree_map(one, kwargs), float64_of)
