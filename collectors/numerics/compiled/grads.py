"""Gradients of a compiled region: the compiled backward's input gradients vs float64 and eager VJPs.

An AOTAutograd-based backend (aot_eager, Inductor, TorchTPU) runs a compiled region as one autograd node
(``CompiledFunction``); a hook on that node receives, during the script's own backward, the gradients flowing into
the region (``grad_outputs``) and the ones the compiled backward produced for the region's inputs
(``grad_inputs``).  The checker then computes the same vector-Jacobian product through the float64 replay of the
graph and through the eager graph at the device dtype, and applies the same verdict as for forward outputs.  The
hook only reads: it returns nothing, so the script's gradients are untouched.  Backends that do not go through
AOTAutograd (``eager``) have no such node; their backward is plain eager autograd, which the eager checker covers.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from tpudiag.oracle import graph as graph_oracle


def _leaves(inputs: list[Any], wanted: list[bool]) -> list[Any]:
    out: list[Any] = []
    for x, w in zip(inputs, wanted, strict=True):
        if w and isinstance(x, torch.Tensor):
            x.requires_grad_(True)
        out.append(x)
    return out


def _vjp(outs: list[Any], leaves: list[Any], grads: list[Any], dtype_of: Any) -> list[Any]:
    from torch.utils._python_dispatch import _disable_current_modes

    pairs = [
        (o, dtype_of(g, o))
        for o, g in zip(outs, grads, strict=False)
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
    ]
    wrt = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    if not pairs or not wrt:
        return []
    with _disable_current_modes(), graph_oracle.preserved_rng():
        got = torch.autograd.grad(
            [p[0] for p in pairs], wrt, grad_outputs=[p[1] for p in pairs], allow_unused=True, retain_graph=False
        )
    it = iter(got)
    return [next(it) if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves]


def compiled_node(outputs: list[Any]) -> Any:
    """The single autograd node every grad-requiring output of the region hangs off (None when there is not one)."""
    nodes = {id(o.grad_fn): o.grad_fn for o in outputs if isinstance(o, torch.Tensor) and o.grad_fn is not None}
    if len(nodes) != 1:
        # Outputs can be views of the compiled node's outputs: look one step down.
        under: dict[int, Any] = {}
        for node in nodes.values():
            if "CompiledFunction" in type(node).__name__:
                under[id(node)] = node
                continue
            for nxt, _ in getattr(node, "next_functions", ()):
                if nxt is not None and "CompiledFunction" in type(nxt).__name__:
                    under[id(nxt)] = nxt
        nodes = under
    if len(nodes) != 1:
        return None
    node = next(iter(nodes.values()))
    return node if "CompiledFunction" in type(node).__name__ else None


def plan(args: tuple[Any, ...], out: Any) -> tuple[Any, list[bool]] | str | None:
    """(the region's autograd node, which inputs want a gradient) when the backward can be checked; a skip reason
    when it cannot; None when this call has no backward (no grad mode, nothing requires grad)."""
    if not torch.is_grad_enabled():
        return None
    wanted = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
    outs = graph_oracle.flat_outputs(out)
    if not any(wanted) or not any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs):
        return None
    node = compiled_node(outs)
    if node is None:
        return "no_compiled_backward"
    return node, wanted


def leaves(inputs: list[Any], wanted: list[bool]) -> list[Any]:
    return _leaves(inputs, wanted)


def arm(
    checker: Any,
    g: Any,
    node: Any,
    wanted: list[bool],
    out: Any,
    fp64_in: list[Any],
    fp64_out: list[Any],
    eager_in: list[Any],
    eager_out: list[Any] | None,
    snapshot: list[Any] | None = None,
) -> dict[str, bool]:
    """Hook the region's backward: at the script's own backward, compare the compiled input gradients with the
    float64 and eager VJPs through the reference forwards made at the forward check (kept until then).  The first
    failing backward of a graph keeps ``snapshot`` (the call's inputs) and its output gradients for localisation,
    unless the checker marks the returned state ``forward_divergent``: the gradients of a call whose forward is already
    off are computed from wrong activations, so the forward's originator explains them."""
    outs = graph_oracle.flat_outputs(out)
    state = {"done": False, "forward_divergent": False}

    def hook(grad_inputs: Any, grad_outputs: Any) -> None:
        if state["done"] or not checker.active:
            return
        state["done"] = True
        try:
            t0 = time.perf_counter()
            failed = _check(
                checker, g, node, wanted, grad_inputs, grad_outputs, outs, fp64_in, fp64_out, eager_in, eager_out
            )
            if failed is not None and snapshot is not None and not state["forward_divergent"]:
                _keep_failing(checker, g, snapshot, wanted, grad_outputs, failed)
            with contextlib.suppress(Exception):
                checker.ctx.budget.charge(time.perf_counter() - t0, f"compiled_graph {g.info.compile_id}", "graph", 0)
        except Exception as e:
            checker._on_error("backward", e)
            g.skipped_bw["tpudiag_error"] = g.skipped_bw.get("tpudiag_error", 0) + 1

    node.register_hook(hook)
    return state


def _check(
    checker: Any,
    g: Any,
    node: Any,
    wanted: list[bool],
    grad_inputs: Any,
    grad_outputs: Any,
    outs: list[Any],
    fp64_in: list[Any],
    fp64_out: list[Any],
    eager_in: list[Any],
    eager_out: list[Any] | None,
) -> tuple[int, int] | None:
    """Writes the backward rows; (node seq, graph seq) when some gradient is divergent, else None."""
    from tpudiag.collectors.numerics.compiled.rows import backward_rows
    from tpudiag.oracle.outputs import check_output, floor_check, within_floor

    n_out = len(grad_outputs)
    # Only the plain layout is read: node outputs = the region's outputs, node inputs = the graph's inputs (AOT
    # puts mutated inputs and aliased bases among the outputs, and may dedupe inputs: those are skipped).  With
    # dynamic shapes the node's inputs are the graph's tensor inputs only (its SymInt inputs are not autograd's).
    tensor_pos = [i for i, x in enumerate(fp64_in) if isinstance(x, torch.Tensor)]
    if len(grad_inputs) != len(wanted) and len(grad_inputs) == len(tensor_pos):
        spread: list[Any] = [None] * len(wanted)
        for i, gr in zip(tensor_pos, grad_inputs, strict=True):
            spread[i] = gr
        grad_inputs = spread
    if n_out != len(outs) or len(grad_inputs) != len(wanted):
        g.skipped_bw["grad_layout"] = g.skipped_bw.get("grad_layout", 0) + 1
        return None
    grads = list(grad_outputs)
    ref64 = _vjp(fp64_out, fp64_in, grads, lambda gr, o: gr.detach().to("cpu", torch.float64))
    if not ref64:
        return None
    pairs = [
        (i, c, r)
        for i, (c, r) in enumerate(zip(grad_inputs, ref64, strict=False))
        if wanted[i] and c is not None and r is not None
    ]
    floors = [within_floor(c, r) for _, c, r in pairs]
    ref: list[Any] = []
    if not all(f is True for f in floors):
        # Some gradient is off by more than the floor: the eager VJP (at the device dtype) decides.
        if eager_out is None:
            eager_out = graph_oracle.replay(g.info.ref, eager_in, grad=True).outputs
        ref = _vjp(eager_out, eager_in, grads, lambda gr, o: gr.detach().to(o.dtype))
    checks = []
    for (i, c, r), floor in zip(pairs, floors, strict=True):
        if floor is True:
            ck: Any = floor_check(c, r)
        else:
            e = ref[i] if i < len(ref) else None
            ck = check_output(c, e, r) if e is not None else None
        if ck is not None:
            checks.append((i, ck))
    return backward_rows(checker, g, checks)


def _keep_failing(
    checker: Any, g: Any, snapshot: list[Any], wanted: list[bool], grad_outputs: Any, seqs: tuple[int, int]
) -> None:
    from tpudiag.collectors.numerics.compiled.checker import MAX_LOCALISED

    if g.failing_bw is not None or sum(1 for x in checker.graphs if x.failing_bw is not None) >= MAX_LOCALISED:
        return
    kept = [gr.detach().clone() if isinstance(gr, torch.Tensor) else None for gr in grad_outputs]
    g.failing_bw = {"inputs": snapshot, "wanted": list(wanted), "grad_outputs": kept, "seqs": seqs}
