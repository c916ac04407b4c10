"""Compile: compile/recompile timeline, cache hit rate, the frames that recompile most (reasons, time)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from tpudiag.app import charts
from tpudiag.app.common import current_run, fmt_num, guarded, load, not_captured, run_heading
from tpudiag.store import Store, queries
from tpudiag.store import dashboard_queries as q


def headline(kinds: list[dict[str, Any]], cache: list[dict[str, Any]]) -> dict[str, Any]:
    """Counts by kind, compile time (all compiling kinds), overall cache hit rate (None: no lookups)."""
    count = {r["kind"]: int(r["events"]) for r in kinds}
    compiling = [r for r in kinds if r["kind"] in q.COMPILE_KINDS]
    hits = sum(int(r["hits"]) for r in cache)
    lookups = hits + sum(int(r["misses"]) for r in cache)
    return {
        "compiles": sum(int(r["events"]) for r in compiling),
        "recompiles": count.get("recompile", 0),
        "graph_breaks": count.get("graph_break", 0),
        # Older collectors wrote failures as their own kind; newer ones flag the event itself.
        "failures": count.get("failure", 0) + sum(int(r.get("failed") or 0) for r in kinds),
        "compile_s": sum(float(r["duration_s"]) for r in compiling),
        "hit_rate": hits / lookups if lookups else None,
        "lookups": lookups,
    }


def frame_rows(frames: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "function": r["function"],
            "where": f"{r['file'] or '?'}:{r['line']}" if r["line"] is not None else r["file"],
            "compiles": r["compiles"],
            "recompiles": r["recompiles"],
            "graph breaks": r["graph_breaks"],
            "compile s": round(float(r["compile_s"]), 3),
            "time lost to recompiles s": round(float(r["recompile_s"]), 3),
            "reasons": " | ".join(r["reasons"] or []),
        }
        for r in frames
    ]


def render(s: Store) -> None:
    rid = current_run(s)
    if rid is None:
        return
    run = queries.resolve_run(s, rid)
    run_heading("Compile", run)
    all_kinds = load("load_compile", s, rid, limit=0)
    if not all_kinds.kinds:
        not_captured("compile or cache events", s, "compile", run)
        return
    h = headline(all_kinds.kinds, all_kinds.cache)
    m = st.columns(6)
    m[0].metric("Compiles", fmt_num(h["compiles"]))
    m[1].metric("Recompiles", fmt_num(h["recompiles"]))
    m[2].metric("Graph breaks", fmt_num(h["graph_breaks"]))
    m[3].metric("Failures", fmt_num(h["failures"]))
    m[4].metric("Compile time", f"{h['compile_s']:.2f} s")
    m[5].metric("Cache hit rate", "–" if h["hit_rate"] is None else f"{100 * h['hit_rate']:.1f} %")
    kinds = [r["kind"] for r in all_kinds.kinds]
    chosen = st.multiselect("Event kinds on the timeline", kinds, default=kinds, key="cp_kinds")
    view = load("load_compile", s, rid, kinds=chosen or kinds)
    left, right = st.columns([2, 1])
    if view.timeline:
        left.plotly_chart(charts.compile_timeline(view.timeline, view.origin_ns), key="cp_timeline")
    if view.cache:
        right.plotly_chart(charts.cache_bars(view.cache), key="cp_cache")
    else:
        right.caption("No cache lookups were recorded.")
    st.subheader("Frames that recompile most")
    if view.frames:
        st.dataframe(frame_rows(view.frames), hide_index=True, key="cp_frames")
    else:
        st.caption("No event names a frame (function, file).")
    if view.reasons:
        st.subheader("Reasons")
        st.dataframe(view.reasons, hide_index=True, key="cp_reasons")


def main() -> None:
    guarded(render)
