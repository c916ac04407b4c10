"""The numerics dispatch mode on real torch ops: in-place, out=, views, random, backward, skips, and the promise
that the user's tensors and results stay bitwise unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tpudiag.collectors.numerics.mode import Context, NumericsMode
from tpudiag.collectors.numerics.records import Recorder
from tpudiag.collectors.numerics.sampling import Budget, SamplingOptions
from tpudiag.model import OpDiff, OpRecord


def run(
    fn: Callable[[], Any], options: SamplingOptions | None = None, **ctx: Any
) -> tuple[Any, list[OpRecord], list[OpDiff]]:
    recorder = Recorder("t", None)
    mode = NumericsMode(Context(run_id="t", **ctx), options or SamplingOptions(mode="all"), recorder)
    with mode:
        result = fn()
    ops, diffs = recorder.drain(final=True)
    return result, ops, diffs


def by_op(ops: list[OpRecord], diffs: list[OpDiff], name: str) -> list[tuple[OpRecord, list[OpDiff]]]:
    return [(o, [d for d in diffs if d.seq == o.seq]) for o in ops if o.op == name]


def test_in_place_ops_compare_against_inputs_captured_before_the_write() -> None:
    x = torch.randn(64)

    def body() -> Any:
        y = x.clone()
        y.mul_(3.0)  # an oracle reading the mutated y would compute 9x and fail
        y.add_(y)  # self-aliasing
        y[:10].sub_(1.0)  # in place on a view
        return y

    y, ops, diffs = run(body)
    for name in ("aten::mul_", "aten::add_", "aten::sub_"):
        found = by_op(ops, diffs, name)
        assert found, name
        for op, ds in found:
            assert op.checked and [d.verdict for d in ds] == ["pass"], (name, ds)
    assert torch.equal(y, torch.cat([x[:10] * 6 - 1, x[10:] * 6]))


def test_out_variant_is_compared_and_writes_only_the_users_out_tensor() -> None:
    a, b = torch.randn(32), torch.randn(32)
    out = torch.full((32,), 123.0)

    def body() -> Any:
        torch.add(a, b, out=out)
        torch.tanh(a, out=out)
        return out

    _, ops, diffs = run(body)
    assert [o.op for o in ops if o.checked] == ["aten::add", "aten::tanh"]
    assert all(o.overload == "out" for o in ops if o.checked)
    assert [d.verdict for d in diffs] == ["pass", "pass"]
    assert torch.equal(out, torch.tanh(a))


def test_faulty_kernel_is_originator_and_shadow_flows_through_views_and_backward(faulty_tanh: None) -> None:
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(16, 16)

    def body() -> Any:
        h = torch.tanh(x @ w)  # originator
        v = h.t()  # view: no arithmetic, but the shadow follows it
        z = (v * 2.0).sum()  # propagators
        z.backward()
        return z

    _, ops, diffs = run(body)
    _, tanh_diffs = by_op(ops, diffs, "aten::tanh")[0]
    assert tanh_diffs[0].verdict == "fail" and tanh_diffs[0].role == "originator"
    assert tanh_diffs[0].max_rel == pytest.approx(3e-3, rel=0.02)
    view = [o for o in ops if o.op == "aten::t" and o.phase == "forward"]
    assert view and view[0].skip_reason == "view"
    _, mul_diffs = by_op(ops, diffs, "aten::mul")[0]
    assert mul_diffs[0].verdict == "pass" and mul_diffs[0].role == "propagator"
    assert (mul_diffs[0].propagated_error or 0) > 1000
    originators = {o.op for o in ops for d in diffs if d.seq == o.seq and d.role == "originator"}
    assert originators == {"aten::tanh"}
    backward = [o for o in ops if o.phase == "backward" and o.checked]
    assert any(o.op == "aten::tanh_backward" for o in backward)
    # tanh_backward uses the faulty tanh output: correct from its inputs, so a propagator.
    tb = by_op(ops, diffs, "aten::tanh_backward")[0][1][0]
    assert tb.verdict == "pass" and tb.role == "propagator"


def test_random_factory_and_uninitialised_ops_are_skipped_with_reasons_and_rng_untouched() -> None:
    def body() -> Any:
        torch.manual_seed(7)
        a = torch.randn(16)
        b = torch.nn.functional.dropout(a, p=0.5, training=True)
        c = torch.empty(4)
        d = torch.zeros(3)
        return a, b, c.shape, d, torch.rand(3)

    (a, b, _, _, after), ops, _ = run(body)
    reasons = {o.op: o.skip_reason for o in ops if not o.checked}
    assert reasons["aten::randn"] == "random"
    assert reasons["aten::bernoulli_"] == "random"  # dropout decomposes into bernoulli_ on CPU
    assert reasons["aten::empty"] == "uninitialized"
    assert reasons["aten::zeros"] in ("factory", "no_arithmetic")
    torch.manual_seed(7)
    a2 = torch.randn(16)
    b2 = torch.nn.functional.dropout(a2, p=0.5, training=True)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert torch.equal(after, torch.rand(3))


def test_as_strided_is_compared_on_the_same_storage_layout() -> None:
    base = torch.randn(6, 6)
    view = base.t()[1:]

    def body() -> Any:
        return torch.as_strided(view, (3, 3), (1, 6), 2).exp()

    _, ops, diffs = run(body)
    strided = by_op(ops, diffs, "aten::as_strided")
    assert strided and strided[0][0].checked and strided[0][1][0].verdict == "pass"


def test_nonunique_outputs_and_size_cap_are_reasoned() -> None:
    m = torch.randn(5, 5)
    sym = m @ m.T

    def body() -> Any:
        torch.linalg.eigh(sym)
        torch.sort(torch.tensor([1.0, 1.0, 0.5]))
        return torch.randn(4, 4).exp()

    _, ops, diffs = run(body)
    eigh = [d for o, ds in by_op(ops, diffs, "aten::_linalg_eigh") for d in ds]
    assert [d.verdict for d in eigh] == ["pass", "skip"] and eigh[1].skip_reason == "nonunique"
    sort = [d for o, ds in by_op(ops, diffs, "aten::sort") for d in ds]
    assert [d.verdict for d in sort] == ["pass", "skip"] and sort[1].skip_reason == "ties"
    _, ops2, _ = run(lambda: torch.ones(100).exp(), size_cap=50)
    assert [o.skip_reason for o in ops2 if o.op == "aten::exp"] == ["size_cap"]


def test_sampling_filters_and_budget_aggregate_skips() -> None:
    x = torch.randn(16)

    def body() -> Any:
        for _ in range(10):
            torch.tanh(x).exp()
        return None

    _, ops, _ = run(body, SamplingOptions(first_k=2))
    tanh_checked = [o for o in ops if o.op == "aten::tanh" and o.checked]
    sampled = [o for o in ops if o.op == "aten::tanh" and o.skip_reason == "sampled"]
    assert len(tanh_checked) == 2 and sampled[0].calls == 8
    _, ops, _ = run(body, SamplingOptions(mode="all", ops=("exp",)))
    assert {o.op for o in ops if o.checked} == {"aten::exp"}
    assert [o.calls for o in ops if o.op == "aten::tanh" and o.skip_reason == "filtered"] == [10]

    recorder = Recorder("t", None)
    mode = NumericsMode(Context(run_id="t"), SamplingOptions(mode="all", budget_pct=1e-9), recorder, Budget(pct=1e-9))
    with mode:
        body()
    ops, _ = recorder.drain(final=True)
    assert sum(o.calls for o in ops if o.skip_reason == "budget") >= 19


def test_users_tensors_and_results_are_bitwise_unchanged_by_the_checker() -> None:
    def train() -> dict[str, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
        )
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        data = torch.randn(8, 12)
        keep = data.clone()
        losses = []
        for _ in range(3):
            opt.zero_grad()
            out = model(data)
            loss = torch.nn.functional.cross_entropy(out, torch.arange(8) % 4)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        buf = torch.empty(8, 4)
        torch.mul(out.detach(), 2.0, out=buf)
        buf.add_(1.0)
        return {
            "params": [p.detach().clone() for p in model.parameters()],
            "grads": [p.grad.clone() for p in model.parameters() if p.grad is not None],
            "losses": losses,
            "buf": buf,
            "data_same": torch.equal(data, keep),
        }

    plain = train()
    checked, ops, diffs = run(train)
    assert sum(o.checked for o in ops) > 50 and diffs
    assert checked["data_same"]
    for key in ("params", "grads", "losses"):
        assert len(plain[key]) == len(checked[key])
        for p, c in zip(plain[key], checked[key], strict=True):
            assert torch.equal(p, c), key  # bitwise (torch.equal is exact)
    assert torch.equal(plain["buf"], checked["buf"])
    assert not [d for d in diffs if d.verdict in ("fail", "overflow")]


def test_a_checked_ops_tensors_are_freed_when_the_script_drops_them_not_at_the_next_garbage_collection() -> None:
    """The checker keeps no reference cycle to an op's arguments or outputs: on a device a tensor kept alive past
    its last use is device memory the plain script would not hold."""
    import gc
    import weakref

    x = torch.randn(1000)
    recorder = Recorder("t", None)
    mode = NumericsMode(Context(run_id="t"), SamplingOptions(mode="all"), recorder)
    gc.disable()
    try:
        with mode:
            values, indices = torch.sort(x)
            y = torch.tanh(values)
        refs = [weakref.ref(t) for t in (values, indices, y)]
        del values, indices, y
        alive = [r() is not None for r in refs]
    finally:
        gc.enable()
    assert alive == [False, False, False]
    assert [o.checked for o in recorder.drain(final=True)[0] if o.op in ("aten::sort", "aten::tanh")] == [True, True]


def test_the_heap_is_trimmed_after_checking_a_large_op_and_not_after_small_ones(monkeypatch: Any) -> None:
    """A float64 replay of a large op frees its temporaries into glibc's heap, which kept them (a trace window
    checking 2M-element sorts held +430 MB until it closed): the checker hands them back after such an op."""
    from tpudiag.collectors.numerics import mode as mode_module
    from tpudiag.longrun import heap

    calls: list[str] = []
    real = heap.release

    def spy(min_interval_s: float = 0.0, caller: str = "") -> bool:
        calls.append(caller)
        return real(min_interval_s, caller)

    monkeypatch.setattr(heap, "release", spy)
    run(lambda: [torch.tanh(torch.ones(8)) for _ in range(3)])
    assert "large check" not in calls
    run(lambda: torch.sort(torch.randn(mode_module.TRIM_AFTER_NUMEL)))
    assert calls.count("large check") == 1


def test_checking_a_training_step_leaves_no_garbage_cycles() -> None:
    """Every object the checker makes for a step is freed by reference counting: nothing (tensors least of all)
    waits for the cyclic garbage collector."""
    import gc

    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    recorder = Recorder("t", None)
    mode = NumericsMode(Context(run_id="t"), SamplingOptions(mode="all"), recorder)

    def step() -> None:
        with mode:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    step()  # first calls: caches, lazy imports
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        step()
        gc.collect()
        garbage = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert garbage == []
    assert sum(o.checked for o in recorder.drain(final=True)[0]) > 20
