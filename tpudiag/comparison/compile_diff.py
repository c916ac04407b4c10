"""Compilation compared: compiles, recompiles (with reasons, and those after warm-up), graph breaks, cache hits
and misses, compile time.  These are exact counts, so they gate exactly (PyTorch's ``check_graph_breaks.py``)."""

from __future__ import annotations

from typing import Any

from tpudiag.comparison.snapshot import Snapshot
from tpudiag.comparison.steps_diff import WARMUP_STEPS

COUNTS = ("compiles", "recompiles", "graph_breaks", "cache_hits", "cache_misses")
# The section's rows, A beside B, in the order the text report and the dashboard show them.
SHOWN = (
    "compiles",
    "recompiles",
    "recompiles_after_warmup",
    "graph_breaks",
    "cache_hits",
    "cache_misses",
    "compile_time_s",
)


def after_warmup(section: dict[str, Any], warmup: int = WARMUP_STEPS) -> list[dict[str, Any]]:
    """Recompiles that happened after the warm-up steps (a run without steps: every recompile)."""
    events = section.get("recompile_events") or []
    return [e for e in events if e.get("step_index") is None or e["step_index"] >= warmup]


def compare_compile(a: Snapshot, b: Snapshot, warmup: int = WARMUP_STEPS) -> dict[str, Any] | None:
    """The ``compile`` section (None when neither run captured compilation)."""
    if a.compile is None and b.compile is None:
        return None
    ca, cb = a.compile or {}, b.compile or {}
    out: dict[str, Any] = {"comparable": a.compile is not None and b.compile is not None}
    if not out["comparable"]:
        out["note"] = f"run {'A' if a.compile is None else 'B'} has no compile data"
    for key in COUNTS:
        va, vb = ca.get(key), cb.get(key)
        out[key] = {"a": va, "b": vb, "delta": (vb or 0) - (va or 0)}
    ta, tb = ca.get("compile_time_s"), cb.get("compile_time_s")
    out["compile_time_s"] = {"a": ta, "b": tb, "ratio": round(tb / ta, 4) if ta and tb is not None else None}
    wa, wb = after_warmup(ca, warmup), after_warmup(cb, warmup)
    out["recompiles_after_warmup"] = {"a": len(wa), "b": len(wb), "delta": len(wb) - len(wa)}
    reasons_a = set(ca.get("recompile_reasons") or [])
    out["new_recompile_reasons"] = [r for r in cb.get("recompile_reasons") or [] if r not in reasons_a]
    out["recompiles_after_warmup_b"] = wb
    sites_a = set(ca.get("graph_break_sites") or [])
    out["new_graph_breaks"] = [s for s in cb.get("graph_break_sites") or [] if s not in sites_a]
    out["fixed_graph_breaks"] = [
        s for s in ca.get("graph_break_sites") or [] if s not in set(cb.get("graph_break_sites") or [])
    ]
    return out
