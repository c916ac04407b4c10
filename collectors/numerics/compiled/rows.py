"""Rows of a compiled region's backward check (the forward rows are written by ``checker``), and the row of the
FX node a localisation names, forward or backward."""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from tpudiag import console
from tpudiag.analysis.op_kinds import op_kind
from tpudiag.analysis.verdict import is_divergent
from tpudiag.collectors.numerics.compiled import nodes as fx_nodes
from tpudiag.model import OpRecord


def backward_rows(checker: Any, g: Any, checks: list[tuple[int, Any]]) -> tuple[int, int] | None:
    """One ``ops`` row for the region's backward, one ``op_diffs`` row per input gradient (output_index = the
    graph input it belongs to).  Returns (node seq, graph seq) when some gradient is divergent: the node seq is
    reserved just before the graph's for the node backward localisation may name (so it sorts first)."""
    if not checks:
        return None
    ctx = checker.ctx
    node_seq = ctx.next_seq()
    seq = ctx.next_seq()
    sources = g.info.sources
    record = OpRecord(
        run_id=ctx.run_id,
        seq=seq,
        op=f"compiled_graph {g.info.compile_id}",
        overload=g.info.backend,
        phase="backward",
        source_loc=g.info.frame,
        dtypes=json.dumps([ck.dtype for _, ck in checks[:64]], separators=(",", ":")),
        checked=True,
        kind="graph",
        region="compiled_graph",
        graph_id=g.info.compile_id,
    )
    names = [_param_name(sources[i]) if i < len(sources) else str(i) for i, _ in checks]
    diffs = [
        dataclasses.replace(d, note=f"gradient of {name}" + (f": {d.note}" if d.note else ""))
        for d, name in zip((ck.diff(ctx.run_id, seq, i) for i, ck in checks), names, strict=True)
    ]
    rec = ctx.recorder
    rec.op(record)
    rec.diffs(diffs)
    rec.findings.seen += 1
    rec.findings.checked += 1
    g.backward_checks += 1
    bad = [(i, ck) for i, ck in checks if is_divergent(ck.verdict.verdict)]
    if bad:
        rec.findings.divergent += 1
        g.backward_divergent += 1
        shown = ", ".join(_param_name(sources[i]) if i < len(sources) else str(i) for i, _ in bad[:3])
        sys.stderr.write(
            f"{console.prefix()}: numerics: the backward of compiled graph {g.info.compile_id} ({g.info.backend}) "
            f"diverges from its float64 replay (gradients of {shown}{', ...' if len(bad) > 3 else ''})\n"
        )
        sys.stderr.flush()
        return node_seq, seq
    return None


def _param_name(source: str | None) -> str:
    """``L['self']._modules['layers']._modules['0']._parameters['weight']`` -> ``layers.0.weight``."""
    if not source:
        return "?"
    from tpudiag.collectors.numerics.compiled.nodes import module_path

    path = module_path(source.replace("._parameters", "").replace("._buffers", ""))
    return path or source.removeprefix("L['").removesuffix("']")


def node_originator_row(
    checker: Any,
    g: Any,
    node: Any,
    node_ops: dict[str, list[str]],
    ck: Any,
    seq: int,
    device: str | None,
    phase: str,
    note: str,
    tail: str = "",
) -> dict[str, Any]:
    """Record ``node`` of compiled graph ``g`` as the originator of a divergence: its ``ops`` row (region
    ``compiled_node``) and its diff, noted ``note``, the node's source line, then ``tail``.  Returns what names it:
    node, op, module, source."""
    aten = node_ops.get(node.name) or []
    op = aten[0] if aten else fx_nodes.target_name(node)
    module = fx_nodes.module_of(node)
    source = fx_nodes.source_of(node)
    run_id = checker.ctx.run_id
    rec = checker.ctx.recorder
    rec.op(
        OpRecord(
            run_id=run_id,
            seq=seq,
            op=op,
            overload=fx_nodes.target_name(node),
            module=module,
            phase=phase,
            source_loc=source,
            dtypes=f'["{ck.dtype}"]',
            device=device,
            checked=True,
            kind=op_kind(op),
            region="compiled_node",
            graph_id=g.info.compile_id,
            fx_node=node.name,
        )
    )
    diff = ck.diff(run_id, seq, 0, role="originator")
    line = fx_nodes.source_text(node)
    note += (f": {line}" if line else "") + tail
    rec.diffs([dataclasses.replace(diff, note=note + (f"; {diff.note}" if diff.note else ""))])
    rec.findings.originators += 1
    return {"node": node.name, "op": op, "module": module, "source": source}
