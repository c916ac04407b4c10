"""Gradient taps (tpudiag.oracle.taps): the tapped graph computes the same forward, and each tap's gradient is
the gradient its edge carries, on real FX graphs (no compile: fast)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from tpudiag.oracle import graph as graph_oracle  # noqa: E402
from tpudiag.oracle import taps  # noqa: E402


def _f(x: Any, w: Any) -> Any:
    h = torch.tanh(x @ w)
    top, _ = torch.max(h, dim=0)  # a tuple-valued node unpacked by getitems
    return (h * h).sum(0) + top


def _values(gm: Any, inputs: list[Any]) -> dict[str, Any]:
    rep = graph_oracle.replay(gm, graph_oracle.clone_inputs(inputs), per_node=True, keep=lambda n: True)
    values = dict(rep.node_values)
    for n, x in zip([n for n in gm.graph.nodes if n.op == "placeholder"], inputs, strict=True):
        values[n.name] = x
    return values


def _tapped() -> tuple[Any, list[Any], taps.Taps]:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(_f)
    inputs = [torch.randn(4, 5), torch.randn(5, 6)]
    return gm, inputs, taps.tapped_graph(gm, _values(gm, inputs))


def test_the_tapped_graph_computes_the_same_forward_bitwise() -> None:
    gm, inputs, t = _tapped()
    assert len(t.edges) == len(t.zeros) > 0
    assert torch.equal(gm(*inputs), t.gm(*inputs, *t.zeros))
    # The original graph is left as it is: no tap nodes, no extra inputs.
    assert not any("tpudiag_tap" in n.name for n in gm.graph.nodes)
    # h is consumed twice by the same mul: one edge, and the tuple of max is passed through its getitems.
    consumers = [(e.producer, e.consumer) for e in t.edges]
    assert consumers.count(("tanh", "mul")) == 1
    assert t.through.get("max_1")


def test_each_tap_gives_the_gradient_its_edge_carries() -> None:
    _, inputs, t = _tapped()
    x, w = (a.clone().requires_grad_(True) for a in inputs)
    eps = [z.clone().requires_grad_(True) for z in t.zeros]
    g = torch.randn(6)
    got = taps.edge_gradients([t.gm(x, w, *eps)], eps, [g])
    by_edge = {(e.producer, e.consumer): v for e, v in zip(t.edges, got, strict=True)}
    h = torch.tanh(inputs[0] @ inputs[1])
    # d/dh of (h*h).sum(0)·g through the mul edge = 2h·g (both uses of h).
    assert torch.allclose(by_edge[("tanh", "mul")], 2 * h * g, atol=1e-6)
    # The matmul -> tanh edge carries the tanh backward of everything above it.
    hh = (inputs[0] @ inputs[1]).requires_grad_(True)
    out = (torch.tanh(hh) * torch.tanh(hh)).sum(0) + torch.max(torch.tanh(hh), dim=0)[0]
    (ref,) = torch.autograd.grad(out, [hh], grad_outputs=[g])
    assert torch.allclose(by_edge[("matmul", "tanh")], ref, atol=1e-6)
    # float64 oracle of the same taps: same edges, same gradients to fp32 accuracy.
    gm64 = graph_oracle.to_float64_graph(t.gm)
    x64, w64 = (a.double().requires_grad_(True) for a in inputs)
    eps64 = [z.double().requires_grad_(True) for z in t.zeros]
    got64 = taps.edge_gradients([gm64(x64, w64, *eps64)], eps64, [g], torch.float64)
    assert all(
        a is None or (b.dtype == torch.float64 and torch.allclose(a.double(), b, atol=1e-5))
        for a, b in zip(got, got64, strict=True)
    )


def test_roles_originator_where_the_outgoing_gradients_still_agree() -> None:
    _, _, t = _tapped()
    edges = t.edges
    # Say the tanh's backward is wrong: its incoming edge (matmul -> tanh) and everything upstream diverge.
    upstream = {("matmul", "tanh"), ("x", "matmul"), ("w", "matmul")}
    divergent = [(e.producer, e.consumer) in upstream for e in edges]
    roles = taps.edge_roles(edges, divergent, t.through)
    assert roles == {"tanh": "originator", "matmul": "propagator"}
    # A divergence entering the tuple-valued max through one of its getitems makes max a propagator, not an
    # originator: its outgoing gradients are those of the getitems.
    via_max = {("tanh", "max_1"), ("getitem", "add")} | upstream
    divergent = [(e.producer, e.consumer) in via_max for e in edges]
    roles = taps.edge_roles(edges, divergent, t.through)
    assert roles.get("max_1") == "propagator" and roles.get("add") == "originator"


def _inplace(x: Any, w: Any) -> Any:
    h = x @ w
    h.mul_(2)  # writes into the matmul's value, which the add below reads
    return torch.tanh(h + x @ w).sum()


def test_in_place_ops_keep_writing_into_their_own_input() -> None:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(_inplace)
    inputs = [torch.randn(3, 4), torch.randn(4, 4)]
    t = taps.tapped_graph(gm, _values(gm, graph_oracle.clone_inputs(inputs)))
    assert torch.equal(gm(*inputs), t.gm(*inputs, *t.zeros))
    edges = {(e.producer, e.consumer) for e in t.edges}
    assert ("matmul", "mul_") not in edges  # the in-place op's own input is not tapped
    assert ("matmul", "add") in edges and ("matmul_1", "add") in edges


def _view_write(x: Any, w: Any) -> Any:
    h = x @ w
    v = h.view(-1)
    v.mul_(2)  # writes into h through a view: a tap on (h -> view) would take the write away from h
    return torch.tanh(h).sum()


def test_a_forward_the_taps_would_change_is_detected_and_not_localised() -> None:
    from tpudiag.collectors.numerics.compiled.localise_backward import _same_forward

    torch.manual_seed(0)
    for fn, same in ((_f, True), (_view_write, False)):
        gm = torch.fx.symbolic_trace(fn)
        inputs = [torch.randn(4, 5), torch.randn(5, 6)]
        t = taps.tapped_graph(gm, _values(gm, graph_oracle.clone_inputs(inputs)))
        original = graph_oracle.replay(gm, graph_oracle.clone_inputs(inputs))
        assert _same_forward(t, inputs, original) is same
