"""Memory: per-step memory, live bytes within a trace window, what was live at the peak by module, the OOM card."""

from __future__ import annotations

from typing import Any

import streamlit as st

from tpudiag import memory_report
from tpudiag.app import memory_charts
from tpudiag.app.common import current_run, guarded, load, not_captured, run_heading
from tpudiag.memory_report import human_bytes
from tpudiag.store import Store, queries


def oom_lines(oom: dict[str, Any]) -> list[str]:
    """The OOM card's lines (plain text: they hold stored strings)."""
    lines = [
        f"kind: {oom['kind']}" + (f" ({oom['phase']})" if oom.get("phase") else ""),
        f"step: {oom['step']}   module: {oom['module'] or '?'}   op: {oom['op'] or '?'}",
        f"asked for: {human_bytes(oom['requested_bytes'])}   live: {human_bytes(oom['live_bytes'])}   "
        f"limit: {human_bytes(oom['limit_bytes'])}   "
        f"last good step's peak: {human_bytes(oom.get('last_good_peak_bytes'))}",
    ]
    return lines


def render(s: Store) -> None:
    rid = current_run(s)
    if rid is None:
        return
    run = queries.resolve_run(s, rid)
    run_heading("Memory", run)
    section = memory_report.build_section(s, run)
    if section is None:
        not_captured("memory figures", s, "memory", run)
        return
    m = st.columns(4)
    m[0].metric("Peak", human_bytes(section["peak_bytes"]))
    m[1].metric("Peak step", "–" if section["peak_step"] is None else str(section["peak_step"]))
    m[2].metric("Limit", human_bytes(section["limit_bytes"]) if section["limit_bytes"] else "–")
    m[3].metric("Per-module method", section["method"] or "none")
    st.caption("Peak source: " + (section["source"] or "no backend answered"))
    oom = section.get("oom")
    if oom:
        st.error("The script ran out of memory.")
        st.text("\n".join(oom_lines(oom)))
        with st.expander("Message"):
            st.code(oom["message"], language="text")
        if oom.get("holders"):
            st.dataframe(oom["holders"], hide_index=True, key="mem_holders")
        if oom.get("allocations"):
            st.subheader("XLA's largest program allocations")
            st.dataframe(oom["allocations"], hide_index=True, key="mem_xla")
    view = load("load_memory", s, rid, window=st.session_state.get("mem_window"))
    fig = memory_charts.per_step_lines(section["per_step"])
    if fig is not None:
        st.plotly_chart(fig, key="mem_steps")
    if view.windows:
        st.selectbox("Trace window", view.windows, index=view.windows.index(view.window), key="mem_window")
        line = memory_charts.window_line(view.timeline)
        if line is not None:
            st.plotly_chart(line, key="mem_window_line")
        tree = memory_charts.module_treemap(section["by_module_at_peak"])
        if tree is not None:
            st.plotly_chart(tree, key="mem_tree")
        st.subheader("Live at the peak")
        st.dataframe(section["at_peak"], hide_index=True, key="mem_at_peak")
        st.subheader("Largest allocations")
        st.dataframe(section["top_allocations"], hide_index=True, key="mem_top")
    else:
        st.info(
            "No trace window recorded the allocator's events. Capture with --profile-memory for live bytes, "
            "the module breakdown at the peak and the largest allocations."
        )


def main() -> None:
    guarded(render)
