"""Gradient taps on the edges of a captured FX graph: one backward run gives the gradient flowing along every edge.

For backward localisation.  In a copy of the graph, every floating tensor a node consumes is routed through
``x + eps`` where ``eps`` is a new graph input (a zero tensor of ``x``'s shape and dtype, so every forward value is
bitwise what it was).  The gradient of ``eps`` after a backward is the gradient that edge carries: what the consumer's
backward gave for that input.  Run the tapped graph once compiled by the user's backend and once as the float64
oracle, with the same output gradients, and compare edge by edge: a node whose outgoing edges still agree with
float64 but one of whose incoming edges does not is where the backward's divergence starts (its backward is the
originator); a node with both is a propagator.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

_COMPUTE = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class Edge:
    """``producer``'s value consumed by ``consumer`` (node names of the original graph)."""

    producer: str
    consumer: str


@dataclass
class Taps:
    gm: torch.fx.GraphModule  # inputs: the original graph's, then one ``eps`` per edge
    edges: list[Edge]  # in tap order
    zeros: list[torch.Tensor]  # the ``eps`` values (zeros)
    through: dict[str, list[str]]  # a node whose value is not one tensor (a tuple) -> its users (getitems)


_INPLACE_OPERATORS = {
    operator.iadd,
    operator.isub,
    operator.imul,
    operator.itruediv,
    operator.ifloordiv,
    operator.imod,
    operator.ipow,
    operator.imatmul,
}


def _mutated_arg(node: torch.fx.Node) -> Any:
    """The argument an in-place node writes into (``x.add_(y)``, ``x += y``, an aten op with a mutable schema), or
    None."""
    if not node.args:
        return None
    target = node.target
    if node.op == "call_method":
        name = str(target)
    elif node.op == "call_function":
        if target in _INPLACE_OPERATORS:
            return node.args[0]
        schema = getattr(target, "_schema", None)
        if schema is not None and getattr(schema, "is_mutable", False):
            return node.args[0]
        name = getattr(target, "__name__", "")
    else:
        return None
    return node.args[0] if name.endswith("_") and not name.startswith("__") else None


def tapped_graph(gm: torch.fx.GraphModule, values: dict[str, Any]) -> Taps:
    """A copy of ``gm`` with a tap on every floating edge into a compute node (``gm`` itself is left as it is).

    ``values``: the value of each node on the failing call (placeholders included), for the taps' shapes and
    dtypes."""
    out = copy.deepcopy(gm)
    graph = out.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last_input = placeholders[-1] if placeholders else None
    edges: list[Edge] = []
    zeros: list[torch.Tensor] = []
    for node in list(graph.nodes):
        if node.op not in _COMPUTE:
            continue
        mutated = _mutated_arg(node)
        for producer in list(node.all_input_nodes):
            if producer is mutated:
                continue  # an in-place op must still write into its own input, not into a tap
            value = values.get(producer.name)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                continue
            if last_input is None:
                with graph.inserting_before(next(iter(graph.nodes))):
                    eps = graph.placeholder(f"tpudiag_tap_{len(edges)}")
            else:
                with graph.inserting_after(last_input):
                    eps = graph.placeholder(f"tpudiag_tap_{len(edges)}")
            last_input = eps
            with graph.inserting_before(node):
                tap = graph.call_function(operator.add, (producer, eps))
            tap.meta = {k: v for k, v in producer.meta.items() if k in ("example_value", "val")}
            node.replace_input_with(producer, tap)
            edges.append(Edge(producer.name, node.name))
            zeros.append(torch.zeros_like(value, memory_format=torch.contiguous_format).detach())
    through = {
        n.name: [u.name for u in n.users]
        for n in graph.nodes
        if n.op in _COMPUTE and n.name in values and not isinstance(values[n.name], torch.Tensor)
    }
    graph.lint()
    out.recompile()
    return Taps(out, edges, zeros, through)


def edge_gradients(
    outputs: Sequence[Any], taps: Sequence[torch.Tensor], grad_outputs: Sequence[Any], dtype: Any = None
) -> list[torch.Tensor | None]:
    """d(outputs · grad_outputs)/d(tap) for every tap (None where no gradient flows); ``dtype`` casts the output
    gradients (float64 for the oracle), else each takes its output's dtype and device."""
    pairs = []
    for o, g in zip(outputs, grad_outputs, strict=False):
        if isinstance(o, torch.Tensor) and o.requires_grad and isinstance(g, torch.Tensor):
            pairs.append((o, g.detach().to(o.device, dtype or o.dtype)))
    if not pairs or not taps:
        return [None] * len(taps)
    got = torch.autograd.grad([p[0] for p in pairs], list(taps), grad_outputs=[p[1] for p in pairs], allow_unused=True)
    return list(got)


def edge_roles(
    edges: Sequence[Edge], divergent: Sequence[bool], through: dict[str, list[str]] | None = None
) -> dict[str, str]:
    """``originator`` / ``propagator`` per consumer node with a divergent incoming edge.

    A node's outgoing gradient edges are the edges where it is the producer (for a tuple-valued node: those of the
    getitems that unpack it); a graph output also receives the output gradient, which is exact.  All outgoing edges
    agree -> the node's own backward made the error (originator)."""
    bad_out: dict[str, bool] = {}
    for e, d in zip(edges, divergent, strict=True):
        bad_out[e.producer] = bad_out.get(e.producer, False) or d
    for name, users in (through or {}).items():
        bad_out[name] = bad_out.get(name, False) or any(bad_out.get(u, False) for u in users)
    roles: dict[str, str] = {}
    for e, d in zip(edges, divergent, strict=True):
        if not d:
            continue
        role = "propagator" if bad_out.get(e.consumer, False) else "originator"
        if roles.get(e.consumer) != "propagator":
            roles[e.consumer] = role
    return roles
