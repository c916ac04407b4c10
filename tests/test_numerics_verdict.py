"""Contract tests of the pure numerics functions: op kinds, thresholds, verdicts, roles, metrics, sampling."""

from __future__ import annotations

import math

import pytest

from tpudiag.analysis.op_kinds import base_name, op_kind
from tpudiag.analysis.verdict import (
    ELEMENTWISE_ULPS,
    Evidence,
    decide,
    is_divergent,
    role,
    threshold,
)
from tpudiag.collectors.numerics.sampling import (
    PRIOR_FIXED_S,
    PRIOR_PER_ELEMENT_S,
    REPEAT_RESERVE,
    Budget,
    Sampler,
    SamplingOptions,
    module_matches,
    op_matches,
    parse_options,
)
from tpudiag.errors import UsageError


@pytest.mark.parametrize(
    ("op", "kind"),
    [
        ("aten::tanh", "elementwise"),
        ("aten::add_.Tensor", "elementwise"),
        ("aten::detach", "elementwise"),
        ("aten::tanh_backward", "elementwise"),
        ("aten::sum.dim_IntList", "reduction"),
        ("aten::det", "reduction"),
        ("aten::mm", "matmul"),
        ("aten::convolution_backward", "matmul"),
        ("aten::native_layer_norm", "normalization"),
        ("aten::_softmax", "normalization"),
        ("aten::eq.Tensor", "discrete"),
        ("aten::_to_copy", "copy"),
        ("aten::polygamma", "special"),
        ("aten::avg_pool2d_backward", "reduction"),
    ],
)
def test_op_kind(op: str, kind: str) -> None:
    assert op_kind(op) == kind


def test_base_name_strips_namespace_and_overload() -> None:
    assert base_name("aten::add_.Tensor") == "add_"
    assert base_name("aten.mm.default") == "mm"
    assert base_name("tanh") == "tanh"


def test_threshold_grows_with_reduction_length_only_for_reductions() -> None:
    assert threshold("elementwise", "float32", 10_000) == ELEMENTWISE_ULPS
    small, big = threshold("reduction", "float32", 4), threshold("reduction", "float32", 40_000)
    assert small < big
    # Even for a very long reduction a 3e-3 fault in fp32 (~25,000 eps) stays far above the limit.
    assert threshold("matmul", "float32", 1 << 16) < 3e-3 / 1.19e-7 / 10


def test_decide_passes_correct_rounding_and_fails_a_fault_of_parts_per_thousand() -> None:
    ok = decide(Evidence(dtype="float32", kind="elementwise", scaled_error=3.0))
    assert ok.verdict == "pass"
    fault = decide(Evidence(dtype="float32", kind="elementwise", scaled_error=2e-3 / 1.1920928955078125e-07))
    assert fault.verdict == "fail" and fault.note


def test_decide_overflow_is_its_own_verdict_before_anything_else() -> None:
    v = decide(Evidence(dtype="float16", kind="elementwise", scaled_error=0.1, overflow=3))
    assert v.verdict == "overflow" and "3 element" in (v.note or "")


def test_decide_discrete_and_nonfinite() -> None:
    assert decide(Evidence(dtype="int64", kind="discrete", mismatch_rate=0.0)).verdict == "pass"
    assert decide(Evidence(dtype="bool", kind="discrete", mismatch_rate=0.25)).verdict == "fail"
    assert decide(Evidence(dtype="float32", kind="elementwise", scaled_error=0, nonfinite_mismatch=1)).verdict == "fail"


def test_decide_normalises_by_the_cpu_kernel_at_the_device_dtype() -> None:
    # 100 eps is over the absolute limit, but the CPU kernel at the same dtype is as bad: not the device's fault.
    worse = Evidence(dtype="float32", kind="elementwise", scaled_error=100.0, ref_scaled_error=60.0)
    assert decide(worse).verdict == "pass"
    assert decide(Evidence(dtype="float32", kind="elementwise", scaled_error=100.0, ref_scaled_error=10.0)).verdict == (
        "fail"
    )
    # k = 3 for 16-bit floats.
    assert (
        decide(Evidence(dtype="bfloat16", kind="elementwise", scaled_error=100.0, ref_scaled_error=34.0)).verdict
        == "pass"
    )


def test_decide_expected_precision_only_with_an_emulated_error() -> None:
    ev = Evidence(dtype="float32", kind="matmul", scaled_error=30_000.0, reduction_len=64)
    assert decide(ev).verdict == "fail"
    matched = Evidence(**{**ev.__dict__, "emulated_scaled_error": 20_000.0})
    assert decide(matched).verdict == "expected_precision"
    far = Evidence(**{**ev.__dict__, "emulated_scaled_error": 10.0})
    assert decide(far).verdict == "fail"


def test_roles() -> None:
    assert role("fail", False) == "originator"
    assert role("overflow", True) == "originator"
    assert role("pass", True) == "propagator"
    assert role("pass", False) is None
    assert is_divergent("fail") and not is_divergent("expected_precision")


# -- metrics ----------------------------------------------------------------------------------------------------
import torch  # noqa: E402


def test_compare_contract_empty_and_inputs_unchanged() -> None:
    from tpudiag.analysis.numerics_metrics import compare

    empty = compare(torch.empty(0), torch.empty(0, dtype=torch.float64))
    assert empty.numel == 0 and empty.scaled_error is None
    a = torch.tensor([1.0, 2.0, float("nan")])
    b = torch.tensor([1.0, 2.0, float("nan")], dtype=torch.float64)
    a0, b0 = a.clone(), b.clone()
    m = compare(a, b)
    assert torch.equal(a.nan_to_num(7), a0.nan_to_num(7)) and torch.equal(b.nan_to_num(7), b0.nan_to_num(7))
    assert m.nan_device == 1 and m.nan_oracle == 1 and m.nonfinite_mismatch == 0 and m.scaled_error == 0.0


def test_compare_metrics_values() -> None:
    from tpudiag.analysis.numerics_metrics import compare

    exp = torch.tensor([1.0, -2.0, 4.0], dtype=torch.float64)
    act = (exp * torch.tensor([1 + 1e-3, 1.0, 1.0], dtype=torch.float64)).float()
    m = compare(act, exp)
    assert m.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert m.max_rel == pytest.approx(1e-3, rel=1e-3)
    assert m.scaled_error == pytest.approx(1e-3 / (4.0 * torch.finfo(torch.float32).eps), rel=1e-3)
    assert m.cosine is not None and 0.999999 < m.cosine <= 1.0
    # 1e-3 at 1.0 in fp32: ulp(1.0) = 2**-23.
    assert m.max_ulp == pytest.approx(1e-3 / 2**-23, rel=1e-2)
    assert m.rmse == pytest.approx(math.sqrt((1e-3) ** 2 / 3), rel=1e-2)


def test_compare_counts_overflow_and_masks_small_values_in_relative_error() -> None:
    from tpudiag.analysis.numerics_metrics import compare

    m = compare(torch.tensor([float("inf"), 1.0], dtype=torch.float16), torch.tensor([7e4, 1.0], dtype=torch.float64))
    assert m.overflow == 1 and m.inf_device == 1 and m.inf_oracle == 0
    tiny = compare(torch.tensor([1.0, 1e-9]), torch.tensor([1.0, 2e-9], dtype=torch.float64))
    assert tiny.max_rel == 0.0  # the 1e-9 element is masked: it carries no relative accuracy


def test_compare_discrete_and_underflow() -> None:
    from tpudiag.analysis.numerics_metrics import compare

    m = compare(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2, 0, 4]))
    assert m.mismatch_rate == 0.25
    # A float64 value below float32's range flushes to 0 in float32: representation, not a wrong kernel.
    under = compare(torch.tensor([0.0]), torch.tensor([1e-50], dtype=torch.float64))
    assert (under.scaled_error or 0) < 1


# -- sampling ---------------------------------------------------------------------------------------------------
def test_parse_options() -> None:
    assert parse_options({}).mode == "sample"
    o = parse_options({"numerics": "5", "budget": "20", "ops": "mm, tanh", "modules": "a.b"})
    assert (o.mode, o.first_k, o.budget_pct, o.ops, o.modules) == ("sample", 5, 20.0, ("mm", "tanh"), ("a.b",))
    assert parse_options({"numerics": "all"}).mode == "all"
    for bad in ({"numerics": "zz"}, {"numerics": "0"}, {"budget": "-1"}, {"budget": "x"}):
        with pytest.raises(UsageError):
            parse_options(bad)


def test_filters() -> None:
    assert op_matches("aten::tanh", ("tanh",)) and op_matches("aten::add_", ("add",))
    assert op_matches("aten::native_layer_norm", ("*norm*",)) and not op_matches("aten::mm", ("tanh",))
    assert op_matches("aten::mm", ())
    assert module_matches("transformer.h.0.mlp.act", ("transformer.h.0",))
    assert not module_matches("transformer.h.10.mlp", ("transformer.h.1",))
    assert module_matches("transformer.h.3.attn", ("transformer.h.*.attn",))
    assert not module_matches(None, ("x",)) and module_matches(None, ())


def test_sampler_first_k_per_signature() -> None:
    s = Sampler(SamplingOptions(first_k=2))
    assert [s.wants(("mm", 1)) for _ in range(4)] == [True, True, False, False]
    assert s.wants(("mm", 2))
    everything = Sampler(SamplingOptions(mode="all"))
    assert all(everything.wants(("x",)) for _ in range(10))


def test_budget_estimate_learns_fixed_plus_rate_times_elements() -> None:
    b = Budget(pct=10.0)
    # Before any check: the prior of the op's kind.
    assert b.estimate("aten::mm", "matmul", 1000) == pytest.approx(PRIOR_FIXED_S + PRIOR_PER_ELEMENT_S["matmul"] * 1000)
    # A check of known cost and size: the estimate for that op becomes fixed + measured rate x n.
    rate = 3e-9
    b.charge(PRIOR_FIXED_S + rate * 10_000, "aten::tanh", "pointwise", 10_000)
    assert b.estimate("aten::tanh", "pointwise", 50_000) == pytest.approx(PRIOR_FIXED_S + rate * 50_000)
    # Another op of the same kind learns from the kind's rate; the checked op's cost is spent.
    assert b.estimate("aten::sin", "pointwise", 2_000) == pytest.approx(PRIOR_FIXED_S + rate * 2_000)
    assert b.spent() == pytest.approx(PRIOR_FIXED_S + rate * 10_000) and b.checks == 1
    # One-time setup inside a check (a compiled graph's float64 copy) is spent but not learnt as the op's rate.
    b.charge(0.02 + PRIOR_FIXED_S + rate * 10_000, "compiled_graph 0/0", "graph", 10_000, setup_s=0.02)
    assert b.estimate("compiled_graph 0/0", "graph", 10_000) == pytest.approx(PRIOR_FIXED_S + rate * 10_000)
    assert b.spent() == pytest.approx(0.02 + 2 * (PRIOR_FIXED_S + rate * 10_000))


def test_budget_refuses_a_check_exactly_when_it_would_exceed_the_allowance() -> None:
    b = Budget(pct=10.0)
    b.charge(0.5, "aten::tanh", "pointwise", 10_000)
    cost = b.estimate("aten::tanh", "pointwise", 10_000)
    spent = b.spent()
    # allowance(elapsed) = 10% x (elapsed - spent): the check fits once that reaches spent + cost.
    edge = (spent + cost) / 0.10 + spent
    assert b.allows_check("aten::tanh", "pointwise", 10_000, edge * (1 + 1e-9), times_checked=0)
    assert not b.allows_check("aten::tanh", "pointwise", 10_000, edge * (1 - 1e-9), times_checked=0)
    # A signature already checked gets only half the allowance: refused at the edge, allowed at twice the need.
    assert not b.allows_check("aten::tanh", "pointwise", 10_000, edge * (1 + 1e-9), times_checked=1)
    edge_repeat = (spent + cost) / (0.10 * REPEAT_RESERVE) + spent
    assert b.allows_check("aten::tanh", "pointwise", 10_000, edge_repeat * (1 + 1e-9), times_checked=3)
    assert not b.allows_check("aten::tanh", "pointwise", 10_000, edge_repeat * (1 - 1e-9), times_checked=3)
    # Watching a step and leaving the stack use the same allowance.
    assert b.affords(cost, edge * (1 + 1e-9)) and not b.affords(cost, edge * (1 - 1e-9))
    assert b.exhausted(elapsed_s=spent / 0.10 + spent - 1e-6) and not b.exhausted(spent / 0.10 + spent + 1e-6)
    unlimited = Budget(pct=None)
    unlimited.charge(100.0)
    assert unlimited.allows_check("aten::mm", "matmul", 10**9, 0.0, 5) and not unlimited.exhausted(0.0)
