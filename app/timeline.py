"""Timeline (issue 21): the whole run's step time from the pulse, with its trace windows marked by reason, and each
window's slowest ops.  The page re-reads the store every few seconds, so a running job's pulse and windows appear
as they land, without a restart."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go
import streamlit as st

from tpudiag.app.common import current_run, guarded, not_captured, run_heading
from tpudiag.store import Store, longrun_queries, queries

REFRESH_S = 5.0
REASON_COLORS = {
    "first_steps": "#bab0ac",
    "schedule": "#72b7b2",
    "slow_step": "#e45756",
    "recompile": "#f58518",
    "graph_break": "#eeca3b",
    "nonfinite": "#b279a2",
    "memory": "#9d755d",
    "numerics": "#ff9da6",
    "manual": "#4c78a8",
    "whole_run": "#54a24b",
}


def step_time_chart(steps: Sequence[dict[str, Any]], windows: Sequence[dict[str, Any]]) -> go.Figure:
    """Step time (ms) against step, one shaded band per window, coloured by its reason."""
    fig = go.Figure()
    fig.add_trace(
        go.Scattergl(
            x=[s["step"] for s in steps],
            y=[s["dur_ns"] / 1e6 for s in steps],
            mode="lines",
            name="step time",
            line={"width": 1, "color": "#4c78a8"},
            hovertemplate="step %{x}: %{y:.2f} ms<extra></extra>",
        )
    )
    shown: set[str] = set()
    for w in windows:
        if w["first_step"] is None:
            continue
        color = REASON_COLORS.get(w["reason"], "#bab0ac")
        fig.add_vrect(
            x0=w["first_step"] - 0.5, x1=(w["last_step"] or w["first_step"]) + 0.5, fillcolor=color, opacity=0.3,
            line_width=0,
        )  # fmt: skip
        if w["reason"] not in shown:  # a legend entry per reason
            shown.add(w["reason"])
            fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=w["reason"], marker={"color": color}))
    fig.update_layout(
        height=380, margin={"l": 10, "r": 10, "t": 30, "b": 10}, xaxis_title="step", yaxis_title="step time (ms)"
    )
    return fig


def window_rows(windows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "window": w["id"],
            "reason": w["reason"],
            "steps": f"{w['first_step']}-{w['last_step']}" if w["first_step"] is not None else "",
            "at s": f"{w['start_s']:.1f}-{w['end_s']:.1f}",
            "events": w["trace_events"],
            "top op": w["top_ops"][0]["name"] if w["top_ops"] else "",
            "detail": w["detail"] or "",
            "pruned": bool(w["pruned"]),
        }
        for w in windows
    ]


@st.fragment(run_every=REFRESH_S)
def live(s: Store, rid: str) -> None:
    summary = longrun_queries.pulse_summary(s, rid)
    if summary is None:
        run = queries.resolve_run(s, rid)
        not_captured("a pulse (steps seen by the trace collector)", s, "trace", run)
        return
    windows = longrun_queries.windows(s, rid)
    m = st.columns(5)
    m[0].metric("Steps", f"{summary['steps']:,}")
    m[1].metric("Step time p50", f"{summary['step_time_p50_s'] * 1e3:.2f} ms")
    m[2].metric("Step time p99", f"{summary['step_time_p99_s'] * 1e3:.2f} ms")
    m[3].metric("Windows", str(len(windows)))
    m[4].metric("Slow steps", str(len(summary["slow_steps"])))
    st.plotly_chart(step_time_chart(longrun_queries.step_times(s, rid), windows), key="tl_steps")
    st.subheader("Trace windows")
    st.dataframe(window_rows(windows), hide_index=True, key="tl_windows")
    for w in windows:
        if w["top_ops"]:
            with st.expander(f"window {w['id']} ({w['reason']}): slowest ops"):
                st.dataframe(w["top_ops"], hide_index=True)


def render(s: Store) -> None:
    rid = current_run(s)
    if rid is None:
        return
    run_heading("Timeline", queries.resolve_run(s, rid))
    live(s, rid)


def main() -> None:
    guarded(render)
