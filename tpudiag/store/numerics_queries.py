"""Read queries over the numerics tables (``ops``, ``op_diffs``): coverage, divergent ops, one op's detail."""

from __future__ import annotations

from typing import Any

from tpudiag.store.database import Store
from tpudiag.store.queries import _dicts

# Verdicts that make an output worth listing (besides any output with a role).
LISTED_VERDICTS = ("fail", "overflow", "expected_precision")


def has_numerics(store: Store, run_id: str) -> bool:
    with store.reader() as r:
        row = r.execute("SELECT count(*) FROM ops WHERE run_id = ?", [run_id]).fetchone()
    return bool(row and row[0])


def coverage(store: Store, run_id: str) -> dict[str, Any]:
    """Op calls and FLOPs seen, checked, and skipped by reason (outputs skipped inside checked ops too)."""
    with store.reader() as r:
        rows = r.execute(
            """
            SELECT checked, coalesce(skip_reason, '') AS reason, sum(calls) AS calls,
                   coalesce(sum(flops), 0) AS flops
            FROM ops WHERE run_id = ? GROUP BY ALL
            """,
            [run_id],
        ).fetchall()
        outputs = r.execute(
            """
            SELECT verdict, coalesce(skip_reason, '') AS reason, count(*) FROM op_diffs
            WHERE run_id = ? GROUP BY ALL
            """,
            [run_id],
        ).fetchall()
    seen = checked = 0
    flops_seen = flops_checked = 0.0
    skipped: dict[str, int] = {}
    skipped_flops: dict[str, float] = {}
    for is_checked, reason, calls, flops in rows:
        seen += int(calls)
        flops_seen += float(flops)
        if is_checked:
            checked += int(calls)
            flops_checked += float(flops)
        else:
            key = reason or "unknown"
            skipped[key] = skipped.get(key, 0) + int(calls)
            skipped_flops[key] = skipped_flops.get(key, 0.0) + float(flops)
    verdicts: dict[str, int] = {}
    outputs_skipped: dict[str, int] = {}
    for verdict, reason, n in outputs:
        verdicts[verdict] = verdicts.get(verdict, 0) + int(n)
        if verdict == "skip":
            outputs_skipped[reason or "unknown"] = outputs_skipped.get(reason or "unknown", 0) + int(n)
    by_region = coverage_by_region(store, run_id)
    return {
        "by_region": by_region,
        "ops_seen": seen,
        "ops_checked": checked,
        "skipped": dict(sorted(skipped.items(), key=lambda kv: -kv[1])),
        "flops_seen": flops_seen,
        "flops_checked": flops_checked,
        "flops_skipped": dict(sorted(skipped_flops.items(), key=lambda kv: -kv[1])),
        "outputs_compared": sum(n for v, n in verdicts.items() if v != "skip"),
        "outputs_by_verdict": verdicts,
        "outputs_skipped": outputs_skipped,
    }


def divergent_outputs(store: Store, run_id: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Outputs with a role (originator/propagator) or a non-pass verdict, with their op, in execution order."""
    sql = """
        SELECT o.seq, o.op, o.overload, o.module, o.phase, o.source_loc, o.kind, o.dtypes, o.shapes, o.device,
               d.output_index, d.verdict, d.role, d.dtype, d.numel, d.max_abs, d.max_rel, d.mean_abs, d.rmse,
               d.cosine, d.max_ulp, d.mean_ulp, d.scaled_error, d.ref_scaled_error, d.propagated_error,
               d.threshold, d.nan_device, d.inf_device, d.nan_oracle, d.inf_oracle, d.mismatch_rate, d.note,
               d.emulated_error, d.precision, d.repro_path, o.region, o.graph_id, o.fx_node, o.overload AS target,
               d.ref_rmse
        FROM op_diffs d JOIN ops o ON o.run_id = d.run_id AND o.seq = d.seq AND o.checked
        WHERE d.run_id = ? AND (d.role IS NOT NULL OR list_contains(?, d.verdict))
        ORDER BY o.seq, d.output_index
    """
    params: list[Any] = [run_id, list(LISTED_VERDICTS)]
    if limit is not None:
        sql += " LIMIT ?"
        params.append(limit)
    with store.reader() as r:
        return _dicts(r.execute(sql, params))


def count_divergent(store: Store, run_id: str) -> dict[str, int]:
    """Distinct op calls per role / verdict among the listed outputs."""
    with store.reader() as r:
        rows = r.execute(
            """
            SELECT coalesce(role, verdict) AS what, count(DISTINCT seq) FROM op_diffs
            WHERE run_id = ? AND (role IS NOT NULL OR list_contains(?, verdict)) GROUP BY ALL
            """,
            [run_id, list(LISTED_VERDICTS)],
        ).fetchall()
    return {str(k): int(n) for k, n in rows}


def op_detail(store: Store, run_id: str, seq: int) -> dict[str, Any] | None:
    """One op call and all its outputs' diffs (None when the run has no such op)."""
    with store.reader() as r:
        ops = _dicts(r.execute("SELECT * FROM ops WHERE run_id = ? AND seq = ? AND calls = 1", [run_id, seq]))
        if not ops:
            return None
        diffs = _dicts(
            r.execute("SELECT * FROM op_diffs WHERE run_id = ? AND seq = ? ORDER BY output_index", [run_id, seq])
        )
    return {**ops[0], "outputs": diffs}


def coverage_by_region(store: Store, run_id: str) -> dict[str, dict[str, Any]]:
    """Calls seen, checked and skipped by reason per region: eager ops, compiled graphs, compiled nodes."""
    with store.reader() as r:
        rows = r.execute(
            """
            SELECT coalesce(region, 'eager_op') AS region, checked, coalesce(skip_reason, '') AS reason,
                   sum(calls) AS calls, count(DISTINCT graph_id) AS graphs
            FROM ops WHERE run_id = ? GROUP BY ALL ORDER BY ALL
            """,
            [run_id],
        ).fetchall()
        divergent = r.execute(
            """
            SELECT coalesce(o.region, 'eager_op'), count(DISTINCT o.seq), count(DISTINCT o.graph_id)
            FROM op_diffs d JOIN ops o ON o.run_id = d.run_id AND o.seq = d.seq AND o.checked
            WHERE d.run_id = ? AND list_contains(['fail', 'overflow'], d.verdict) GROUP BY ALL
            """,
            [run_id],
        ).fetchall()
    out: dict[str, dict[str, Any]] = {}
    for region, is_checked, reason, calls, _graphs in rows:
        entry = out.setdefault(region, {"seen": 0, "checked": 0, "skipped": {}, "divergent": 0})
        entry["seen"] += int(calls)
        if is_checked:
            entry["checked"] += int(calls)
        else:
            entry["skipped"][reason or "unknown"] = entry["skipped"].get(reason or "unknown", 0) + int(calls)
    for region, calls, graphs in divergent:
        entry = out.setdefault(region, {"seen": 0, "checked": 0, "skipped": {}, "divergent": 0})
        entry["divergent"] = int(calls)
        if region != "eager_op":
            entry["divergent_graphs"] = int(graphs)
    return out
