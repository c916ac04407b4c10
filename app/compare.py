"""Compare: two runs side by side — op time deltas, what changed in numerics and in compilation.

The numbers come from ``tpudiag.comparison`` (the code behind ``tpudiag compare`` and ``tpudiag check``), so the
page and the command line always agree: the same alignment, statistics, categories and numerics changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import streamlit as st

from tpudiag.app import charts
from tpudiag.app.common import (
    LOCK_TIMEOUT_S,
    RUN_KEY,
    empty_store,
    fmt_ns,
    fmt_num,
    guarded,
    load,
    run_label,
    store_version,
)
from tpudiag.comparison import compile_diff, stats
from tpudiag.comparison.dashboard_view import load_view
from tpudiag.store import Store
from tpudiag.store_access import open_store


@st.cache_data(max_entries=64, show_spinner=False)
def _view(path: str, version: tuple[int, ...], run_a: str, run_b: str) -> dict[str, Any]:
    return load_view(open_store(path, lock_timeout_s=LOCK_TIMEOUT_S), run_a, run_b)


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 6)


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
    view = _view(str(s.path), store_version(s), run_a, run_b)
    result = view["result"]
    st.dataframe(side_by_side(view["runs"]["a"], view["runs"]["b"]), hide_index=True, key="cmp_summary")
    comparable = result["comparable"]
    for problem in comparable["problems"]:
        st.warning("Not comparable: " + problem)
    if comparable["differences"]:
        st.dataframe(
            [{"field": d["field"], "in A": str(d["a"]), "in B": str(d["b"])} for d in comparable["differences"]],
            hide_index=True,
            key="cmp_fingerprint",
        )
    if view["runs"]["a"].get("time_source") != view["runs"]["b"].get("time_source"):
        st.warning("One run has device times and the other host times: op times are not directly comparable.")
    steps = result["steps"]
    if steps.get("steady"):
        st.subheader("Steps")
        st.dataframe(
            [
                {
                    "": label,
                    "median ms A": _ms(d["median_a"]),
                    "median ms B": _ms(d["median_b"]),
                    "B/A": round(d["ratio"], 3) if d["ratio"] is not None else None,
                    "p": d["p_value"],
                    "n": stats.sample_count(d),
                    "verdict": d["verdict"],
                }
                for label, d in (("first step", steps["first"]), ("steady step", steps["steady"]))
            ],
            hide_index=True,
            key="cmp_steps",
        )
    st.subheader("Op time")
    if result["ops"].get("uniform_shift"):
        st.warning(result["ops"]["uniform_shift"]["notice"])
    if view["ops"]:
        left, right = st.columns([1, 1])
        left.plotly_chart(charts.delta_bars(view["ops"][:20]), key="cmp_delta")
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
                for r in view["ops"]
            ],
            hide_index=True,
            key="cmp_ops",
        )
        st.dataframe(
            [
                {
                    "op": e["op"],
                    "module": e["module"],
                    "category": e["category"],
                    "ms/step A": _ms(e["per_step_s_a"]),
                    "ms/step B": _ms(e["per_step_s_b"]),
                    "B/A": e["ratio"],
                    "of step %": round(e["impact"] * 100, 3) if e["impact"] is not None else None,
                    "q": e.get("q_value"),
                }
                for e in result["ops"]["entries"][:200]
            ],
            hide_index=True,
            key="cmp_aligned",
        )
    else:
        st.caption("Neither run has op events.")
    st.subheader("Numerics")
    numerics = result["numerics"] or {}
    if numerics.get("changes"):
        first = numerics.get("first_new_divergence")
        if first:
            st.text(f"first new divergence: {first['op']} in {first['module']} at {first['source']}")
        st.dataframe(numerics["changes"], hide_index=True, key="cmp_numerics")
    else:
        st.caption("No numerics change between the runs (or numerics were not captured).")
    st.subheader("Compilation")
    comp = result["compile"]
    if comp:
        st.dataframe(
            [{"count": k, "A": comp[k]["a"], "B": comp[k]["b"]} for k in compile_diff.SHOWN],
            hide_index=True,
            key="cmp_compile",
        )
        for site in comp["new_graph_breaks"]:
            st.text("new graph break: " + site)
    else:
        st.caption("No compile data in either run.")


def main() -> None:
    guarded(render)
