"""Runs: every run with status, device, duration and headline numbers; filter, search, pick."""

from __future__ import annotations

import time
from typing import Any

import streamlit as st

from tpudiag.app import charts
from tpudiag.app.common import RUN_KEY, empty_store, fmt_ns, guarded, load
from tpudiag.model import RUN_STATUSES
from tpudiag.store import Store


def run_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs table: one plain-value row per run (strings stay strings: the grid shows them as text)."""
    out = []
    for r in runs:
        seq = r.get("first_divergence_seq")
        divergence = None
        if seq is not None:
            divergence = f"{r.get('first_divergence_op') or '?'} @ {seq}"
            if r.get("first_divergence_module"):
                divergence += f" ({r['first_divergence_module']})"
        elif r.get("ops_checked"):
            divergence = "none"
        slowest = None
        if r.get("slowest_op"):
            source = "device" if r.get("device") else "host"
            slowest = f"{r['slowest_op']} ({fmt_ns(r.get('slowest_self_ns'))} {source})"
        out.append(
            {
                "name": r["name"],
                "id": r["id"],
                "status": r["status"],
                "exit": r.get("exit_code"),
                "device": " ".join(str(x) for x in (r.get("device_kind"), r.get("device_name")) if x) or None,
                "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["started_at"] or 0)),
                "duration s": round(r["duration_s"], 2) if r.get("duration_s") is not None else None,
                "trace events": r.get("events"),
                "slowest op": slowest,
                "first divergence": divergence,
                "recompiles": r.get("recompiles"),
                "script": r.get("script"),
            }
        )
    return out


def render(s: Store) -> None:
    st.header("Runs")
    if not s.exists():
        empty_store(s)
        return
    c1, c2 = st.columns([2, 1])
    search = c1.text_input("Search name, id or script", key="runs_search").strip()
    statuses = c2.multiselect("Status", list(RUN_STATUSES), key="runs_status")
    view = load("load_runs", s, search or None, statuses or None)
    if not view.total and not search and not statuses:
        empty_store(s)
        return
    st.text(f"{view.total} run(s) match" + (f", newest {len(view.runs)} shown" if view.total > len(view.runs) else ""))
    if not view.runs:
        return
    ids = [r["id"] for r in view.runs]

    def pick() -> None:
        rows = st.session_state["runs_table"].selection.rows
        if rows:
            st.session_state[RUN_KEY] = ids[rows[0]]

    st.dataframe(run_rows(view.runs), hide_index=True, key="runs_table", on_select=pick, selection_mode="single-row")
    st.caption(
        "Click a row to select that run (or use the sidebar); the Slow ops, Numerics and Compile pages "
        "show the selected run, Compare takes two."
    )
    st.plotly_chart(charts.run_durations(view.runs), key="runs_durations")


def main() -> None:
    guarded(render)
