"""Compare: two runs side by side — op time deltas, what changed in numerics and in compilation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import streamlit as st

from tpudiag.app import charts
from tpudiag.app.common import RUN_KEY, empty_store, fmt_ns, fmt_num, guarded, load, run_label
from tpudiag.store import Store


def side_by_side(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, str]]:
    """Rows of the headline table: one metric per row, run A and run B as text."""

    def dur(r: dict[str, Any]) -> str:
        return f"{r['duration_s']:.2f} s" if r.get("duration_s") is not None else "–"

    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("status", lambda r: str(r.get("status"))),
        (
            "device",
            lambda r: " ".join(str(x) for x in (r.get("device_kind"), r.get("device_name")) if x) or "–",
        ),
        ("script", lambda r: str(r.get("script") or "–")),
        ("duration", dur),
        ("time source", lambda r: str(r.get("time_source"))),
        ("op self time", lambda r: fmt_ns(r.get("op_self_ns"))),
        ("op events", lambda r: fmt_num(r.get("op_events"))),
        ("steps", lambda r: fmt_num(r.get("steps"))),
        ("median step", lambda r: fmt_ns(r.get("median_step_ns"))),
    ]
    return [{"metric": name, "A": fn(a), "B": fn(b)} for name, fn in rows]


def render(s: Store) -> None:
    st.header("Compare")
    choices = load("list_run_choices", s) if s.exists() else []
    if not choices:
        empty_store(s)
        return
    if len(choices) < 2:
        st.info("Comparing needs two runs; this store has one. Capture another run, then refresh.")
        return
    ids = [c["id"] for c in choices]
    labels = {c["id"]: run_label(c) for c in choices}
    selected = st.session_state.get(RUN_KEY)
    b_default = ids.index(selected) if selected in ids else 0
    a_default = b_default + 1 if b_default + 1 < len(ids) else 0
    c1, c2 = st.columns(2)
    run_a = c1.selectbox("Run A (baseline)", ids, index=a_default, format_func=labels.__getitem__, key="cmp_a")
    run_b = c2.selectbox("Run B", ids, index=b_default, format_func=labels.__getitem__, key="cmp_b")
    if run_a == run_b:
        st.warning("Pick two different runs.")
        return
    view = load("load_compare", s, run_a, run_b)
    st.dataframe(side_by_side(view.runs["a"], view.runs["b"]), hide_index=True, key="cmp_summary")
    if view.runs["a"].get("time_source") != view.runs["b"].get("time_source"):
        st.warning("One run has device times and the other host times: op times are not directly comparable.")
    st.subheader("Op time")
    if view.ops:
        left, right = st.columns([1, 1])
        left.plotly_chart(charts.delta_bars(view.ops[:20]), key="cmp_delta")
        right.dataframe(
            [
                {
                    "op": r["name"],
                    "calls A": r["calls_a"],
                    "calls B": r["calls_b"],
                    "self ms A": r["self_ns_a"] / 1e6,
                    "self ms B": r["self_ns_b"] / 1e6,
                    "Δ ms": r["delta_ns"] / 1e6,
                    "ratio B/A": round(r["self_ns_b"] / r["self_ns_a"], 3) if r["self_ns_a"] else None,
                }
                for r in view.ops
            ],
            hide_index=True,
            key="cmp_ops",
        )
    else:
        st.caption("Neither run has op events.")
    st.subheader("Numerics")
    if view.numerics:
        st.dataframe(view.numerics, hide_index=True, key="cmp_numerics")
    else:
        st.caption("No divergent op in either run (or numerics were not captured).")
    st.subheader("Compilation")
    if view.compile:
        st.dataframe(view.compile, hide_index=True, key="cmp_compile")
    else:
        st.caption("No compile events in either run.")


def main() -> None:
    guarded(render)
