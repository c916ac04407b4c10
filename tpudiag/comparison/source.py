"""Where a comparison's runs come from: a run in the store (id, unique name, id prefix) or a snapshot file."""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

from tpudiag import compile_report
from tpudiag.comparison import snapshot
from tpudiag.comparison.snapshot import Snapshot
from tpudiag.store import Store, compare_queries, compile_queries, queries


def looks_like_file(ref: str) -> bool:
    return ref.endswith(".json") or Path(ref).is_file()


def snapshot_of(store: Store, ref: str) -> Snapshot:
    """``ref`` as a snapshot: a snapshot file when it names one, else a run of the store."""
    if looks_like_file(ref):
        return snapshot.load(Path(ref))
    run = queries.resolve_run(store, ref)
    return snapshot_of_run(store, run)


def snapshot_of_run(store: Store, run: dict[str, Any]) -> Snapshot:
    material = compare_queries.run_material(store, run["id"], snapshot.MAX_OPS)
    from tpudiag import memory_report
    from tpudiag.comparison.memory_diff import memory_summary

    memory = memory_summary(memory_report.build_section(store, run), material["steps"])
    return snapshot.build(run, material, _compile_section(store, run, material["steps"]), memory)


def _compile_section(store: Store, run: dict[str, Any], steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    counts = compile_queries.count_by_kind(store, run["id"])
    if not counts and "compile" not in (run.get("collectors") or []):
        return None
    events = compile_queries.compile_events(store, run["id"])
    section = compile_report.summarize(events)
    starts = [int(s["start_ns"]) for s in steps]

    def step_at(ts: int | None) -> int | None:
        """Index (in time order) of the step an event fell in or after; None before the first step."""
        if ts is None or not starts:
            return None
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 else None

    section["recompile_events"] = [
        {
            "function": e.function,
            "file": e.file,
            "line": e.line,
            "reason": e.reason,
            "step_index": step_at(e.ts_ns),
            "failed": e.failed,
        }
        for e in events
        if e.kind == "recompile"
    ]
    section["graph_break_sites"] = sorted({f"{e.file}:{e.line}: {e.reason}" for e in events if e.kind == "graph_break"})
    section.pop("by_frame", None)
    return section
