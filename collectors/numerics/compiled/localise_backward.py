"""Find the FX node whose backward starts a compiled region's gradient divergence, after the script ends.

From the first failing backward of a graph (its inputs and the output gradients the script's backward fed it),
the graph is rebuilt with a gradient tap on every floating edge (``oracle.taps``: ``x + eps``, ``eps`` a zero
input, so the forward is bitwise unchanged) and run forward + backward three ways on the same inputs and output
gradients: compiled with the user's own backend (one compile, whatever the backend: its backward is the one under
test), as the float64 oracle, and eagerly at the device dtype (the reference error).  The gradient of each tap is
the gradient that edge carries; each gets the same verdict as a graph output.  A node whose outgoing gradients
still agree with float64 while one of its inputs' gradients does not is where the divergence starts: its backward
is the originator (the nodes upstream are propagators).  The report names the forward node it belongs to: its aten
op, module path (``nn_module_stack``) and the user's source line (``stack_trace``), phase ``backward``.

As for the forward localisation, the compile is the user's backend at work, not the script's: Dynamo's counters
and the RNG state are put back afterwards, and the script has already finished when this runs.
"""

from __future__ import annotations

from typing import Any

import torch

from tpudiag.analysis.verdict import is_divergent
from tpudiag.collectors.numerics.compiled.checker import CompiledChecker, Graph
from tpudiag.collectors.numerics.compiled.localise import _dynamo_state_kept
from tpudiag.collectors.numerics.compiled.rows import node_originator_row
from tpudiag.oracle import graph as graph_oracle
from tpudiag.oracle import taps as taps_oracle
from tpudiag.oracle.outputs import OutputCheck, check_output


def _node_values(g: Graph, inputs: list[Any]) -> tuple[dict[str, Any], graph_oracle.Replay]:
    """Every node's value on the failing call at the device dtype (placeholders: the inputs), and the replay (its
    outputs, the aten ops each node ran)."""
    eager = graph_oracle.replay(g.info.ref, graph_oracle.clone_inputs(inputs), per_node=True, keep=lambda n: True)
    values = dict(eager.node_values)
    placeholders = [n for n in g.info.ref.graph.nodes if n.op == "placeholder"]
    for n, x in zip(placeholders, inputs, strict=False):
        values[n.name] = x
    return values, eager


def _same_forward(taps: taps_oracle.Taps, inputs: list[Any], eager: graph_oracle.Replay) -> bool:
    """Whether the tapped graph computes bitwise the original's outputs (taps are ``+ 0``: they do unless a view of
    a tapped value is written in place)."""
    again = graph_oracle.replay(taps.gm, [*graph_oracle.clone_inputs(inputs), *taps.zeros]).outputs
    return len(again) == len(eager.outputs) and all(
        torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) else True
        for a, b in zip(again, eager.outputs, strict=True)
    )


def _leaves(inputs: list[Any], wanted: list[bool], zeros: list[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """(graph inputs with ``requires_grad`` where the region had it, the taps as grad-requiring leaves)."""
    args = [
        x.detach().clone().requires_grad_(True) if w and isinstance(x, torch.Tensor) else x
        for x, w in zip(inputs, wanted, strict=False)
    ]
    eps = [z.clone().requires_grad_(True) for z in zeros]
    return args, eps


def _edge_grads(fn: Any, inputs: list[Any], wanted: list[bool], zeros: list[Any], grads: list[Any], dtype: Any) -> Any:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.enable_grad():
        args, eps = _leaves(inputs, wanted, zeros)
        outs = graph_oracle.flat_outputs(fn(*args, *eps))
        return taps_oracle.edge_gradients(outs, eps, grads, dtype)


def localise_backward(checker: CompiledChecker, g: Graph) -> bool:
    """Name the node whose backward starts ``g``'s gradient divergence; writes its row.  True when found."""
    failing = g.failing_bw
    assert failing is not None
    inputs, wanted, grads = failing["inputs"], failing["wanted"], failing["grad_outputs"]
    with _dynamo_state_kept():
        values, eager_replay = _node_values(g, inputs)
        node_ops = eager_replay.node_ops
        taps = taps_oracle.tapped_graph(g.info.ref, values)
        if not taps.edges:
            failing["localised"] = "no floating edge to tap"
            return False
        if not _same_forward(taps, inputs, eager_replay):
            failing["localised"] = "gradient taps change this graph's forward (in-place writes through views)"
            return False
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes(), torch.enable_grad():
            example, eps = _leaves(graph_oracle.clone_inputs(inputs), wanted, taps.zeros)
            compiled = g.info.compiler_fn(taps.gm, [*example, *eps])
        got = _edge_grads(compiled, graph_oracle.clone_inputs(inputs), wanted, taps.zeros, grads, None)
        fp64_gm = graph_oracle.to_float64_graph(taps.gm)
        zeros64 = [z.double() for z in taps.zeros]
        ref = _edge_grads(fp64_gm, graph_oracle.float64_inputs(inputs), wanted, zeros64, grads, torch.float64)
        eager = _edge_grads(taps.gm, graph_oracle.clone_inputs(inputs), wanted, taps.zeros, grads, None)
    checks: list[OutputCheck | None] = []
    for c, r, e in zip(got, ref, eager, strict=True):
        checks.append(check_output(c, e, r) if c is not None and r is not None else None)
    divergent = [ck is not None and is_divergent(ck.verdict.verdict) for ck in checks]
    if not any(divergent):
        failing["localised"] = "the divergence does not show with gradient taps (fusion-dependent?)"
        return False
    roles = taps_oracle.edge_roles(taps.edges, divergent, taps.through)
    order = {n.name: i for i, n in enumerate(g.info.ref.graph.nodes)}
    originators = sorted((name for name, role in roles.items() if role == "originator"), key=order.__getitem__)
    if not originators:
        failing["localised"] = "no node starts the divergence (every divergent gradient comes from a later one)"
        return False
    # The backward runs the graph in reverse: the last originator in forward order is where it starts.
    name = originators[-1]
    bad = [(i, ck) for i, (e, ck) in enumerate(zip(taps.edges, checks, strict=True)) if e.consumer == name and ck]
    # Of its inputs' gradients that diverge, the one furthest from float64 relative to eager.
    index, ck = max((x for x in bad if divergent[x[0]]), key=lambda x: x[1].rmse / max(x[1].ref_rmse or 0.0, 1e-300))
    _write_row(checker, g, name, node_ops, ck, taps.edges[index].producer, len(originators), len(taps.edges))
    return True


def _write_row(
    checker: CompiledChecker,
    g: Graph,
    name: str,
    node_ops: dict[str, list[str]],
    ck: OutputCheck,
    wrt: str,
    n_originators: int,
    n_edges: int,
) -> None:
    failing = g.failing_bw
    assert failing is not None
    node = next(n for n in g.info.ref.graph.nodes if n.name == name)
    node_seq, _graph_seq = failing["seqs"]
    device = next((str(x.device) for x in failing["inputs"] if isinstance(x, torch.Tensor)), None)
    note = f"first divergent node of the backward of compiled graph {g.info.compile_id} ({g.info.backend}), "
    note += f"gradient with respect to its input {wrt}"
    tail = f" ({n_originators - 1} more node(s) start a divergence of their own)" if n_originators > 1 else ""
    named = node_originator_row(checker, g, node, node_ops, ck, node_seq, device, "backward", note, tail)
    failing["localised"] = {**named, "edges": n_edges, "originators": n_originators}
    op, module, source = named["op"], named["module"], named["source"]
    if checker.ctx.note is not None:
        checker.ctx.note(
            f"numerics: the backward of compiled graph {g.info.compile_id} ({g.info.backend}) first diverges at "
            f"node {name} ({op}, {module or 'no module'}, {source or 'source unknown'}), found with one compile "
            f"of the graph with {n_edges} gradient taps"
        )
