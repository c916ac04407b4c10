"""Slow ops: top ops by self time (device time when the run has a device trace), the module tree, time per
step, one step's timeline, and one op in detail (calls, shapes, time distribution, where in the code)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from tpudiag.app import charts, xla_ops
from tpudiag.app.common import current_run, fmt_ns, fmt_num, guarded, load, not_captured, run_heading
from tpudiag.store import Store, queries
from tpudiag.store import dashboard_queries as q

ALL = "(all)"
EAGER_DETAIL_EVENTS = 1_000_000
DEFAULT_TOP = 25
GROUP_LABELS = {"op": "op", "op_module": "op and module", "module": "module"}


def top_table(rows: list[dict[str, Any]], total_self_ns: int, grouping: str = "op_module") -> list[dict[str, Any]]:
    """The rows of the top-ops table: times in ms, each op's share of all op self time."""
    keys = {"op": ("op",), "module": ("module",)}.get(grouping, ("op", "module"))
    return [
        {
            **{k: r["name" if k == "op" else "module"] for k in keys},
            "calls": r["calls"],
            "self ms": round(r["self_ns"] / 1e6, 3),
            "total ms": round(r["total_ns"] / 1e6, 3),
            "mean self µs": round(r["mean_self_ns"] / 1e3, 2),
            "max self µs": round(r["max_self_ns"] / 1e3, 2),
            "share %": round(100.0 * r["self_ns"] / total_self_ns, 2) if total_self_ns else 0.0,
        }
        for r in rows
    ]


def module_paths(rows: list[dict[str, Any]]) -> list[str]:
    """Every module path in the roll-up and all its ancestors (``a``, ``a.b`` for ``a.b.c``), sorted."""
    paths: set[str] = set()
    for r in rows:
        if r["module"]:
            parts = str(r["module"]).split(".")
            paths.update(".".join(parts[: i + 1]) for i in range(len(parts)))
    return sorted(paths)


def _filters(view_modules: list[str], steps: list[int]) -> tuple[str, q.OpFilter, int]:
    c1, c2, c3, c4, c5, c6 = st.columns([1.2, 1, 1.4, 1.6, 1, 1])
    grouping = c1.selectbox("Group by", list(GROUP_LABELS), format_func=GROUP_LABELS.__getitem__, key="so_group")
    phase = c2.selectbox("Phase", [ALL, *q.PHASES], key="so_phase")
    name = c3.text_input("Op name contains", key="so_name").strip()
    module = c4.selectbox("Module (and below)", [ALL, *view_modules], key="so_module")
    step = c5.selectbox("Step", [ALL, *steps], key="so_step")
    limit = c6.number_input("Top N", min_value=5, max_value=200, value=DEFAULT_TOP, step=5, key="so_top")
    f = q.OpFilter(
        phase=None if phase == ALL else phase,
        name_contains=name or None,
        module=None if module == ALL else module,
        step=None if step == ALL else int(str(step)),
    )
    return grouping, f, int(limit)


def render(s: Store) -> None:
    rid = current_run(s)
    if rid is None:
        return
    run = queries.resolve_run(s, rid)
    run_heading("Slow ops", run)
    # The unfiltered view doubles as the filters' choices (its module roll-up lists every module), so a first
    # visit costs one set of scans, and later visits with the default filters none (cached).
    default = load("load_slow_ops", s, rid, "op", q.OpFilter(), DEFAULT_TOP)
    if not default.totals["events"]:
        not_captured("op events", s, "trace", run)
        return
    grouping, f, limit = _filters(module_paths(default.modules), [r["step"] for r in default.steps])
    chosen = (grouping, f, limit) != ("op", q.OpFilter(), DEFAULT_TOP)
    view = load("load_slow_ops", s, rid, grouping, f, limit) if chosen else default
    source = "device" if view.time_source == "device" else "host"
    m = st.columns(5)
    m[0].metric("Time source", f"{source} time")
    xla = xla_ops.section_of(s, run)
    chips = len(xla["devices"]) if xla else 1
    m[1].metric("Op self time" + (f" (sum of {chips} chips)" if chips > 1 else ""), fmt_ns(view.totals["self_ns"]))
    m[2].metric("Op events", fmt_num(view.totals["events"]))
    m[3].metric("Modules", fmt_num(sum(1 for r in view.modules if r["module"])))
    m[4].metric("Steps", fmt_num(len(view.steps)))
    if view.time_source == "host":
        st.caption("No device trace in this run: times are host (CPU) self times of aten ops.")
    if not view.top:
        st.warning("No op matches these filters.")
        return
    left, right = st.columns([1.1, 1])
    left.plotly_chart(charts.top_ops_bar(view.top, f"Top ops by self time ({source})"), key="so_top_chart")
    tree = charts.module_tree(view.modules)
    if tree is not None:
        right.plotly_chart(tree, key="so_tree")
    st.dataframe(top_table(view.top, int(view.totals["self_ns"]), grouping), hide_index=True, key="so_table")
    xla_ops.render(xla)  # XLA runs: per chip, per HLO op, against the chip's peaks

    if view.steps:
        st.subheader("Steps")
        big = view.totals["events"] > EAGER_DETAIL_EVENTS
        by_op = st.toggle("Break each step down by op", value=not big, key="so_by_op")
        rows, per_bar = [], 1
        if by_op:
            b = load("load_step_breakdown", s, rid, f, len(view.steps))
            rows, per_bar = b.rows, b.steps_per_bar
        fig = charts.step_breakdown(view.steps, rows)
        if fig is not None:
            st.plotly_chart(fig, key="so_steps")
        if per_bar > 1:
            st.caption(f"{len(view.steps)} steps: each bar is the mean of {per_bar} consecutive steps.")
        _timeline(s, rid, [r["step"] for r in view.steps], f.step)
    else:
        st.caption("No steps were found in this run's trace.")

    st.subheader("Op detail")
    names = [r["name"] for r in view.top if r["name"] is not None] or [
        r["name"] for r in load("load_slow_ops", s, rid, "op", f, limit).top
    ]
    names = list(dict.fromkeys(names))
    if not names:
        return
    # On big runs each detail query scans the run's events: open the slowest op only on request.
    eager = view.totals["events"] <= EAGER_DETAIL_EVENTS
    op = st.selectbox("Op", names, index=0 if eager else None, placeholder="choose an op", key="so_op")
    if op is not None:
        _op_detail(s, rid, op, f)


def _timeline(s: Store, rid: str, steps: list[int], preferred: int | None) -> None:
    if not steps:
        return
    index = steps.index(preferred) if preferred in steps else 0
    step = st.selectbox("Timeline of step", steps, index=index, key="so_timeline_step")
    tl = load("load_step_timeline", s, rid, int(step))
    if tl is None or not tl.events:
        st.caption("No events inside this step.")
        return
    st.text(f"step {tl.step}: {fmt_ns(tl.dur_ns)} wall; showing the {tl.shown} longest of {tl.total} events")
    st.plotly_chart(charts.step_timeline(tl.events), key="so_timeline")


def _op_detail(s: Store, rid: str, name: str, f: q.OpFilter) -> None:
    d = load("load_op_detail", s, rid, name, f)
    st.text(name)
    m = st.columns(6)
    m[0].metric("Calls", fmt_num(d.summary["calls"]))
    m[1].metric("Self", fmt_ns(d.summary["self_ns"]))
    m[2].metric("Total", fmt_ns(d.summary["total_ns"]))
    m[3].metric("Median self", fmt_ns(d.summary["median_self_ns"]))
    m[4].metric("p95 self", fmt_ns(d.summary["p95_self_ns"]))
    m[5].metric("Max self", fmt_ns(d.summary["max_self_ns"]))
    left, right = st.columns(2)
    if d.histogram:
        left.plotly_chart(charts.histogram(d.histogram), key="so_hist")
    if d.per_step:
        right.plotly_chart(charts.per_step_bar(d.per_step, "Self time per step"), key="so_op_steps")
    st.caption("Input shapes and dtypes")
    st.dataframe(
        [
            {"shapes": r["shapes"], "dtypes": r["dtypes"], "calls": r["calls"], "self ms": r["self_ns"] / 1e6}
            for r in d.shapes
        ],
        hide_index=True,
        key="so_shapes",
    )
    st.caption("Where in the code (module, phase, source line)")
    st.dataframe(
        [
            {
                "module": r["module"],
                "phase": r["phase"],
                "source": r["source_loc"],
                "calls": r["calls"],
                "self ms": r["self_ns"] / 1e6,
            }
            for r in d.places
        ],
        hide_index=True,
        key="so_places",
    )


def main() -> None:
    guarded(render)
