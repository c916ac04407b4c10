"""Find the FX node where a compiled graph's divergence starts, after the script ends, from the kept inputs.

Per-node float64 values come from an FX interpreter over the float64 replay (and per-node eager values at the
device dtype, the reference error); device values come from *prefixes* of the graph compiled with the user's own
backend: prefix k returns every floating node value up to compute node k.  "Some node <= k diverges" is monotone
in k, so a binary search finds the first divergent node in about log2(N) backend compiles.  That node is the
originator (its own inputs still agree with float64: the nodes before it pass); the report names its op (aten ops
it ran), module path (``nn_module_stack``) and source line (``stack_trace``).

Sub-graph compiles are the user's backend at work, not the script's: Dynamo's counters are saved before and put
back after, the RNG state too, and the script has already finished when this runs.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch

from tpudiag.analysis.verdict import is_divergent
from tpudiag.collectors.numerics.compiled.checker import CompiledChecker, Graph
from tpudiag.collectors.numerics.compiled.rows import node_originator_row
from tpudiag.oracle import graph as graph_oracle
from tpudiag.oracle.outputs import check_output

MAX_PROBES = 24


@contextlib.contextmanager
def _dynamo_state_kept() -> Any:
    from torch._dynamo.utils import counters

    saved = copy.deepcopy(counters)
    try:
        with graph_oracle.preserved_rng():
            yield
    finally:
        counters.clear()
        counters.update(saved)


def _run_prefix(g: Graph, upto: int, inputs: list[Any]) -> tuple[list[str], list[Any]]:
    prefix, names = graph_oracle.prefix_graph(g.info.ref, upto)
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        example = graph_oracle.clone_inputs(inputs)
        compiled = g.info.compiler_fn(prefix, example)
        out = compiled(*graph_oracle.clone_inputs(inputs))
    return names, graph_oracle.flat_outputs(out)


def localise_graph(checker: CompiledChecker, g: Graph) -> bool:
    """Bisect ``g``'s failing call down to its originating node; writes the node row.  True when found."""
    failing = g.failing
    assert failing is not None
    inputs = failing["inputs"]
    ref_gm = g.info.ref
    keep = graph_oracle.floating_value
    with _dynamo_state_kept():
        fp64 = graph_oracle.replay(g.fp64, graph_oracle.float64_inputs(inputs), per_node=True, keep=keep)
        eager = graph_oracle.replay(ref_gm, graph_oracle.clone_inputs(inputs), per_node=True, keep=keep)
        compute = graph_oracle.compute_nodes(ref_gm)
        candidates = [i for i, n in enumerate(compute) if keep(n)]
        if not candidates:
            return False
        probes: dict[int, Any] = {}

        def first_bad(pos: int) -> Any:
            """(node name, OutputCheck) of the first divergent node up to candidates[pos], or None."""
            if pos in probes:
                return probes[pos]
            names, outs = _run_prefix(g, candidates[pos], inputs)
            found = None
            for name, value in zip(names, outs, strict=False):
                r = fp64.node_values.get(name)
                e = eager.node_values.get(name)
                if r is None or e is None:
                    continue
                ck = check_output(value, e, r)
                if ck is not None and is_divergent(ck.verdict.verdict):
                    found = (name, ck)
                    break
            probes[pos] = found
            return found

        lo, hi = 0, len(candidates) - 1
        if first_bad(hi) is None:
            failing["localised"] = "the divergence does not show in sub-graphs (fusion-dependent?)"
            return False
        while lo < hi and len(probes) < MAX_PROBES:
            mid = (lo + hi) // 2
            if first_bad(mid) is not None:
                hi = mid
            else:
                lo = mid + 1
        found = first_bad(hi)
    name, ck = found
    node = next(n for n in ref_gm.graph.nodes if n.name == name)
    note = f"first divergent node of compiled graph {g.info.compile_id} ({g.info.backend})"
    named = node_originator_row(
        checker, g, node, fp64.node_ops, ck, failing["node_seq"], failing["record"].device, "forward", note
    )
    failing["localised"] = {**named, "probes": len(probes)}
    op, module, source = named["op"], named["module"], named["source"]
    sys_note = checker.ctx.note
    if sys_note is not None:
        sys_note(
            f"numerics: compiled graph {g.info.compile_id} ({g.info.backend}) first diverges at node {name} "
            f"({op}, {module or 'no module'}, {source or 'source unknown'}) after {len(probes)} sub-graph compiles"
        )
    return True
