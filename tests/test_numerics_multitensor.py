"""Multi-tensor optimizer ops and SDPA under the numerics mode: clean in every configuration, a planted fault found.

Issue 19: the HF ``Trainer``'s default optimizer (fused AdamW, two parameter groups) drew three false originators in
``aten::_fused_adamw_`` and a compiled GPT-2 one in SDPA backward, while their repro bundles passed.  The cause was
the float64 copy cache trusting version counters: fused optimizer kernels never bump them and ``_foreach_*_`` ops do
not under a dispatch mode, so a step count one behind reached the oracle.  Here the optimizers' fused and foreach
paths run over several parameter groups, weight decay, amsgrad, maximize, capturable and lr as a tensor or a float,
with the default sampling (which leaves some writers unchecked, as in the Trainer) and with every call checked:
0 originators, their ops really checked, results bitwise as without the mode.  A wrong kernel planted in one op is
the only originator.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from tpudiag.collectors.numerics.mode import Context, NumericsMode
from tpudiag.collectors.numerics.records import Recorder
from tpudiag.collectors.numerics.sampling import SamplingOptions
from tpudiag.model import OpDiff, OpRecord

FAULT = 1e-3  # relative error of a planted float32 kernel (thousands of scaled eps)


def _run(fn: Callable[[], Any], mode: str) -> tuple[Any, list[OpRecord], list[OpDiff], NumericsMode]:
    recorder = Recorder("t", None)
    m = NumericsMode(Context(run_id="t"), SamplingOptions(mode=mode), recorder)
    with m:
        result = fn()
    ops, diffs = recorder.drain(final=True)
    return result, ops, diffs, m


def _originators(ops: list[OpRecord], diffs: list[OpDiff]) -> list[str]:
    names = {o.seq: o.op for o in ops}
    return sorted({names[d.seq] for d in diffs if d.role == "originator"})


def _checked(ops: list[OpRecord], prefix: str) -> int:
    return sum(1 for o in ops if o.checked and o.op.startswith(prefix))


@pytest.fixture
def library() -> Iterator[Callable[[str, Callable[..., Any]], None]]:
    """Register float32-faulty CPU kernels over aten ops for one test (float64, the oracle's dtype, stays exact)."""
    lib = torch.library.Library("aten", "IMPL")

    def plant(name: str, kernel: Callable[..., Any]) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl(name, kernel, "CPU")

    yield plant
    lib._destroy()


# -- optimizers --------------------------------------------------------------------------------------------------
SHAPES = [(8, 4), (4,), (3, 3), (5,), (6, 2)]


def _groups(params: list[torch.nn.Parameter], groups: int, lr: Any) -> list[dict[str, Any]]:
    if groups == 1:
        return [{"params": params, "weight_decay": 0.01}]
    # Decay / no decay, as transformers' Trainer builds them, plus a third group with its own lr.
    third_lr = torch.tensor(2e-2) if isinstance(lr, torch.Tensor) else 2e-2
    return [
        {"params": [params[0], params[2]], "weight_decay": 0.1},
        {"params": [params[1], params[3]], "weight_decay": 0.0},
        {"params": [params[4]], "weight_decay": 0.05, "lr": third_lr},
    ][:groups]


def _train(cls: type[torch.optim.Optimizer], groups: int, steps: int = 4, **kw: Any) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    lr = kw.pop("lr", 1e-2)
    opt = cls(_groups(params, groups, lr), lr=lr, **kw)
    xs = [torch.randn(s, generator=gen) for s in SHAPES]
    for step in range(steps):
        # Gradient accumulation over two micro-batches, then clipping (foreach norm and mul), then the step.
        for micro in range(2):
            loss = sum(((p * x).sin() * (step + micro + 1)).sum() for p, x in zip(params, xs, strict=True))
            loss.backward()  # type: ignore[union-attr]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()
    state = [t for p in params for t in opt.state[p].values() if isinstance(t, torch.Tensor)]
    return [p.detach().clone() for p in params] + [t.clone() for t in state]


ADAM_CONFIGS = [
    # (impl, groups, extra options)
    ("fused", 2, {}),
    ("fused", 3, {"amsgrad": True}),
    ("fused", 2, {"maximize": True}),
    ("fused", 3, {"capturable": True}),
    ("fused", 2, {"lr": torch.tensor(1e-2)}),
    ("fused", 3, {"lr": torch.tensor(1e-2), "amsgrad": True, "maximize": True}),
    ("fused", 1, {}),
    ("foreach", 2, {}),
    ("foreach", 3, {"amsgrad": True, "maximize": True}),
    ("foreach", 1, {"amsgrad": True}),
]
SGD_CONFIGS = [
    ("fused", 2, {"momentum": 0.9}),
    ("fused", 3, {"momentum": 0.9, "nesterov": True, "maximize": True}),
    ("fused", 2, {"lr": torch.tensor(1e-2), "momentum": 0.9}),
    ("foreach", 2, {"momentum": 0.9}),
    ("foreach", 3, {"momentum": 0.9, "dampening": 0.1, "maximize": True}),
    ("foreach", 2, {"lr": torch.tensor(1e-2)}),
]
CONFIGS = [
    (cls, impl, groups, opts)
    for cls in (torch.optim.Adam, torch.optim.AdamW)
    for impl, groups, opts in ADAM_CONFIGS
    # A few Adam rows are enough next to AdamW's (the same kernels, coupled weight decay).
    if cls is torch.optim.AdamW or (impl, groups) in (("fused", 2), ("foreach", 3))
] + [(torch.optim.SGD, impl, groups, opts) for impl, groups, opts in SGD_CONFIGS]


def _config_id(c: tuple[Any, ...]) -> str:
    cls, impl, groups, opts = c
    extra = "-".join(f"{k}" + ("T" if isinstance(v, torch.Tensor) else "") for k, v in opts.items()) or "plain"
    return f"{cls.__name__}-{impl}-{groups}g-{extra}"


@pytest.mark.parametrize("sampling", ["sample", "all"])
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_optimizer_multi_tensor_ops_are_clean(config: tuple[Any, ...], sampling: str) -> None:
    cls, impl, groups, opts = config

    def train() -> list[torch.Tensor]:
        return _train(cls, groups, **{impl: True}, **dict(opts))

    plain = train()
    result, ops, diffs, _ = _run(train, sampling)
    assert all(torch.equal(a, b) for a, b in zip(plain, result, strict=True))
    assert _originators(ops, diffs) == []
    assert not [d for d in diffs if d.role is not None]
    prefix = "aten::_fused_" if impl == "fused" else "aten::_foreach_"
    assert _checked(ops, prefix) > 0
    if impl == "fused" and cls is not torch.optim.SGD:
        # The fused kernel reads the step counts that an unchecked or checked _foreach_add_ wrote without a version
        # bump: the kept float64 copy of each was refused, never fed to the oracle.
        assert _checked(ops, "aten::_foreach_add_") > 0


def _exact_fused_adamw(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    max_exp_avg_sqs: list[torch.Tensor],
    state_steps: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool,
    maximize: bool,
    grad_scale: Any = None,
    found_inf: Any = None,
) -> None:
    """AdamW (decoupled decay) computed in float64; the float32 exp_avg written FAULT too large."""
    assert not amsgrad and not maximize and grad_scale is None and found_inf is None
    for p, g, m, v, st in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=True):
        step = float(st)
        p64, g64, m64, v64 = (t.double() for t in (p, g, m, v))
        p64 = p64 * (1 - lr * weight_decay)
        m64 = m64 + (g64 - m64) * (1 - beta1)
        v64 = v64 * beta2 + g64 * g64 * (1 - beta2)
        denom = (v64.sqrt() / math.sqrt(1 - beta2**step)) + eps
        p64 = p64 - (lr / (1 - beta1**step)) * m64 / denom
        if p.dtype == torch.float32:
            m64 = m64 * (1 + FAULT)
        p.copy_(p64)
        m.copy_(m64)
        v.copy_(v64)


def _exact_foreach_lerp(self: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> None:
    for s, e in zip(self, ends, strict=True):
        value = s.double() + (e.double() - s.double()) * weight
        s.copy_(value * (1 + FAULT) if s.dtype == torch.float32 else value)


def _exact_foreach_add_list(self: list[torch.Tensor], other: list[torch.Tensor], *, alpha: float = 1) -> None:
    for s, o in zip(self, other, strict=True):
        value = s.double() + o.double() * alpha
        s.copy_(value + FAULT * value.abs().amax() if s.dtype == torch.float32 else value)


@pytest.mark.parametrize(
    ("cls", "impl", "op", "kernel"),
    [
        (torch.optim.AdamW, "fused", "_fused_adamw_", _exact_fused_adamw),
        (torch.optim.Adam, "foreach", "_foreach_lerp_.Scalar", _exact_foreach_lerp),
        (torch.optim.SGD, "foreach", "_foreach_add_.List", _exact_foreach_add_list),
    ],
    ids=["fused_adamw", "foreach_lerp", "foreach_add"],
)
def test_a_planted_fault_in_one_multi_tensor_op_is_the_only_originator(
    library: Callable[[str, Callable[..., Any]], None], cls: Any, impl: str, op: str, kernel: Any
) -> None:
    library(op, kernel)
    _, ops, diffs, _ = _run(lambda: _train(cls, 2, **{impl: True}), "sample")
    assert _originators(ops, diffs) == [f"aten::{op.split('.')[0]}"]


def test_a_write_the_version_counter_misses_never_reaches_the_oracle() -> None:
    """A tensor read (its float64 copy kept), then written with no version bump, then read again."""
    x = torch.randn(64)

    def body() -> torch.Tensor:
        torch.tanh(x)
        x.numpy()[:] *= 3.0  # below the dispatcher: neither the mode nor the version counter sees it
        return torch.sin(x)

    _, ops, diffs, mode = _run(body, "all")
    assert mode.copies.stale == 1
    assert [d.verdict for d in diffs] == ["pass", "pass"] and _originators(ops, diffs) == []


# -- SDPA ---------------------------------------------------------------------------------------------------------
def _sdpa_train(backend: SDPBackend, causal: bool, mask: str | None, steps: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    b, h, n, d = 2, 2, 8, 16
    w = torch.nn.Parameter(torch.randn(d, 3 * d, generator=gen) / 4)
    x = torch.randn(b, h, n, d, generator=gen)
    attn_mask: torch.Tensor | None = None
    if mask == "bool":
        attn_mask = torch.rand(n, n, generator=gen) > 0.3
        attn_mask |= torch.eye(n, dtype=torch.bool)
    elif mask == "float":
        attn_mask = torch.randn(n, n, generator=gen)
    out = []
    with sdpa_kernel([backend]):
        for _ in range(steps):
            q, k, v = (x @ w).split(d, dim=-1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=causal)
            (o.sin() * o).sum().backward()
            out += [o.detach().clone(), w.grad.clone()]  # type: ignore[union-attr]
            w.grad = None
    return out


SDPA_VARIANTS = [
    (backend, causal, mask)
    for backend in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION)
    for causal, mask in ((False, None), (True, None), (False, "bool"), (False, "float"))
]


@pytest.mark.parametrize(
    ("backend", "causal", "mask"), SDPA_VARIANTS, ids=[f"{b.name}-{c}-{m}" for b, c, m in SDPA_VARIANTS]
)
def test_sdpa_forward_and_backward_are_clean(backend: SDPBackend, causal: bool, mask: str | None) -> None:
    plain = _sdpa_train(backend, causal, mask)
    result, ops, diffs, _ = _run(lambda: _sdpa_train(backend, causal, mask), "sample")
    assert all(torch.equal(a, b) for a, b in zip(plain, result, strict=True))
    assert _originators(ops, diffs) == [] and not [d for d in diffs if d.role is not None]
    used = {o.op for o in ops}
    if backend == SDPBackend.FLASH_ATTENTION:
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" in used
        assert _checked(ops, "aten::_scaled_dot_product_flash_attention_for_cpu_backward") > 0
    else:
        assert "aten::_scaled_dot_product_flash_attention_for_cpu" not in used
        assert _checked(ops, "aten::_softmax") > 0 and _checked(ops, "aten::_softmax_backward_data") > 0


FLASH_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _exact_flash_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    logsumexp: torch.Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention backward in float64 (no mask, no dropout); the float32 grad_q FAULT too large."""
    assert attn_mask is None and dropout_p == 0.0
    go, q64, k64, v64 = (t.double() for t in (grad_out, q, k, v))
    s = (scale if scale is not None else 1 / math.sqrt(q.shape[-1])) * (q64 @ k64.transpose(-2, -1))
    if is_causal:
        n, m = s.shape[-2:]
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(), float("-inf"))
    e = (s - s.amax(-1, keepdim=True)).exp()
    p = e / e.sum(-1, keepdim=True)
    o = p @ v64
    dv = p.transpose(-2, -1) @ go
    dp = go @ v64.transpose(-2, -1)
    ds = p * (dp - (go * o).sum(-1, keepdim=True))
    sc = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
    dq, dk = sc * (ds @ k64), sc * (ds.transpose(-2, -1) @ q64)
    if q.dtype == torch.float32:
        dq = dq * (1 + FAULT)
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def _exact_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    x64 = x.double()
    e = (x64 - x64.amax(dim, keepdim=True)).exp()
    value = e / e.sum(dim, keepdim=True)
    return (value * (1 + FAULT)).float() if x.dtype == torch.float32 else value.to(x.dtype)


@pytest.mark.parametrize(
    ("backend", "causal", "op", "kernel"),
    [
        (
            SDPBackend.FLASH_ATTENTION,
            True,
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            _exact_flash_backward,
        ),
        (
            SDPBackend.FLASH_ATTENTION,
            False,
            "_scaled_dot_product_flash_attention_for_cpu_backward",
            _exact_flash_backward,
        ),
        (SDPBackend.MATH, True, "_softmax", _exact_softmax),
    ],
    # The math path calls _softmax inside _safe_softmax (the op the mode sees): that call is the originator.
    ids=["flash-backward-causal", "flash-backward", "math-softmax"],
)
def test_a_planted_fault_in_sdpa_is_the_only_originator(
    library: Callable[[str, Callable[..., Any]], None], backend: SDPBackend, causal: bool, op: str, kernel: Any
) -> None:
    library(op, kernel)
    _, ops, diffs, _ = _run(lambda: _sdpa_train(backend, causal, None), "sample")
    assert _originators(ops, diffs) == [f"aten::{'_safe_softmax' if op == '_softmax' else op}"]


# -- mixed precision ------------------------------------------------------------------------------------------------
def test_mixed_precision_kernels_are_judged_at_their_least_precise_input() -> None:
    """bf16 autocast on the CPU: a LayerNorm's backward takes bf16 activations and gradients with float32 weights
    and writes float32 weight/bias gradients rounded as bf16 work is (2e4 float32 eps: issue 19's Accelerator loop).
    Judged at bf16 they pass; a float32-only op next to them is still judged at float32."""
    from tpudiag.analysis.verdict import working_dtype

    assert working_dtype("float32", ["bfloat16", "float32"]) == "bfloat16"
    assert working_dtype("float32", ["float32", "int64"]) == "float32"
    assert working_dtype("bfloat16", ["float32"]) == "bfloat16"
    assert working_dtype("int64", ["bfloat16"]) == "int64"
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    )
    xs = [torch.randn(8, 16, generator=gen) for _ in range(3)]

    def step() -> list[torch.Tensor]:
        for x in xs:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x).float().square().mean()
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    _, ops, diffs, _ = _run(step, "all")
    ln = [o for o in ops if o.op == "aten::native_layer_norm_backward" and o.checked]
    assert ln and all('"bfloat16"' in (o.dtypes or "") for o in ln)
    ln_diffs = [d for d in diffs if d.seq in {o.seq for o in ln} and d.dtype == "float32"]
    assert ln_diffs and all(d.verdict == "pass" and "judged at bfloat16" in (d.note or "") for d in ln_diffs)
    assert _originators(ops, diffs) == []
