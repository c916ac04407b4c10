"""What the dashboard's Compare page shows, taken from the same comparison as ``tpudiag compare`` (one
implementation): the headline numbers of both runs, op times rolled up per op name for the chart, and the full
comparison (steps, aligned ops with categories, numerics changes, compile changes)."""

from __future__ import annotations

import statistics
from typing import Any

from tpudiag.comparison.compare import compare
from tpudiag.comparison.snapshot import Snapshot
from tpudiag.comparison.source import snapshot_of_run
from tpudiag.store import Store, queries


def headline(s: Snapshot) -> dict[str, Any]:
    durs = [st["dur_ns"] for st in s.steps]
    return {
        **s.run,
        "time_source": s.time_source,
        "op_self_ns": s.op_self_ns,
        "op_events": s.op_events,
        "steps": len(durs),
        "median_step_ns": statistics.median(durs) if durs else None,
    }


def ops_by_name(result: dict[str, Any], limit: int = 30) -> list[dict[str, Any]]:
    """The aligned ops summed over modules: one row per op name, largest |B − A| self time first."""
    rows: dict[str, dict[str, Any]] = {}
    for e in result["ops"]["entries"]:
        r = rows.setdefault(e["op"], {"name": e["op"], "calls_a": 0, "calls_b": 0, "self_ns_a": 0, "self_ns_b": 0})
        r["calls_a"] += e["calls_a"]
        r["calls_b"] += e["calls_b"]
        r["self_ns_a"] += e["self_ns_a"]
        r["self_ns_b"] += e["self_ns_b"]
    out = list(rows.values())
    for r in out:
        r["delta_ns"] = r["self_ns_b"] - r["self_ns_a"]
    out.sort(key=lambda r: (-abs(r["delta_ns"]), r["name"]))
    return out[:limit]


def load_view(store: Store, run_a: str, run_b: str) -> dict[str, Any]:
    a = snapshot_of_run(store, queries.resolve_run(store, run_a))
    b = snapshot_of_run(store, queries.resolve_run(store, run_b))
    result = compare(a, b)
    return {"runs": {"a": headline(a), "b": headline(b)}, "ops": ops_by_name(result), "result": result}
