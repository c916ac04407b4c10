"""Slow ops, per-step breakdown, one op's detail and one step's timeline (the Slow ops page)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpudiag.store.dashboard_queries.session import (
    BREAKDOWN_OPS,
    GROUPINGS,
    MAX_STEP_BARS,
    OpFilter,
    Session,
    filter_sql,
    op_categories,
)
from tpudiag.store.database import Store


@dataclass
class SlowOpsView:
    time_source: str  # "device" | "host"
    totals: dict[str, Any]
    top: list[dict[str, Any]]
    modules: list[dict[str, Any]]
    steps: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)


def load_slow_ops(
    store: Store, run_id: str, grouping: str = "op", f: OpFilter | None = None, limit: int = 25
) -> SlowOpsView:
    """Top ops by self time, every module's self time (whose sums are the totals) and the steps."""
    if grouping not in GROUPINGS:
        raise ValueError(f"grouping must be one of {GROUPINGS}")
    f = f or OpFilter()
    cond, cparams = filter_sql(f)
    with store.reader() as con:
        s = Session(con)
        source, cats = op_categories(s, run_id)
        bparams: list[Any] = [run_id, cats]
        keys = {"op": "name", "op_module": "name, module", "module": "module"}[grouping]
        select = {"op": "name, NULL AS module", "op_module": "name, module", "module": "NULL AS name, module"}
        # The run's op_summary (written when the run finished) answers every filter but the step one from a few
        # thousand pre-aggregated rows; runs without it (still running) are aggregated from their events.
        summarized = f.step is None and bool(
            s.one("summary", "SELECT 1 AS yes FROM op_summary WHERE run_id = ? LIMIT 1", [run_id])
        )
        if summarized:
            base = "FROM op_summary WHERE run_id = ? AND list_contains(?, category)"
            calls, self_sum, dur_sum, max_self = "sum(calls)", "sum(self_ns)", "sum(dur_ns)", "max(max_self_ns)"
        else:
            base = "FROM trace_events WHERE run_id = ? AND list_contains(?, category)"
            calls, self_sum, dur_sum, max_self = "count(*)", "sum(self_ns)", "sum(dur_ns)", "max(self_ns)"
        top = s.rows(
            "top_ops",
            f"""
            SELECT {select[grouping]}, {calls} AS calls, {self_sum} AS self_ns, {dur_sum} AS total_ns,
                   {self_sum} / {calls} AS mean_self_ns, {max_self} AS max_self_ns
            {base}{cond} GROUP BY {keys} ORDER BY self_ns DESC, {keys} LIMIT ?
            """,
            [*bparams, *cparams, limit],
        )
        # Every module's row (module paths are few): the page's totals are their sums, which saves a scan.
        modules = s.rows(
            "module_tree",
            f"SELECT module, {calls} AS calls, {self_sum} AS self_ns {base}{cond} "
            "GROUP BY module ORDER BY self_ns DESC",
            [*bparams, *cparams],
        )
        totals = {
            "events": sum(int(r["calls"]) for r in modules),
            "self_ns": sum(int(r["self_ns"]) for r in modules),
        }
        steps = s.rows(
            "steps",
            "SELECT step, start_ns, dur_ns, kind, input_shapes FROM steps WHERE run_id = ? "
            "ORDER BY rank, step LIMIT 5000",
            [run_id],
        )
        return SlowOpsView(source, totals, top, modules, steps, s.timings)


@dataclass
class StepBreakdown:
    rows: list[dict[str, Any]]  # step (first of its bar), name, self_ns (mean per step of the bar)
    steps_per_bar: int
    timings: dict[str, float] = field(default_factory=dict)


def load_step_breakdown(store: Store, run_id: str, f: OpFilter | None = None, steps: int = 0) -> StepBreakdown:
    """The self time of the run's top ops per step.

    Past ``MAX_STEP_BARS`` steps, consecutive steps share a bar (mean per step), so the chart stays light.
    """
    f = f or OpFilter()
    cond, cparams = filter_sql(f)
    width = max(1, -(-steps // MAX_STEP_BARS))
    with store.reader() as con:
        s = Session(con)
        _source, cats = op_categories(s, run_id)
        base = "FROM trace_events WHERE run_id = ? AND list_contains(?, category)"
        params: list[Any] = [run_id, cats, *cparams]
        names = [
            r["name"]
            for r in s.rows(
                "breakdown_names",
                f"SELECT name {base}{cond} GROUP BY name ORDER BY sum(self_ns) DESC, name LIMIT ?",
                [*params, BREAKDOWN_OPS],
            )
        ]
        rows = s.rows(
            "step_breakdown",
            f"""
            SELECT min(step) AS step, name, sum(self_ns) / ? AS self_ns
            {base}{cond} AND step IS NOT NULL AND list_contains(?, name)
            GROUP BY step // ?, name ORDER BY step, self_ns DESC
            """,
            [width, *params, names, width],
        )
        return StepBreakdown(rows, width, s.timings)


@dataclass
class OpDetail:
    name: str
    summary: dict[str, Any]
    shapes: list[dict[str, Any]]
    places: list[dict[str, Any]]
    histogram: list[dict[str, Any]]
    per_step: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)


def load_op_detail(store: Store, run_id: str, name: str, f: OpFilter | None = None) -> OpDetail:
    """One op: calls, time distribution, the shapes it ran with, where in the code, time per step."""
    f = f or OpFilter()
    cond, cparams = filter_sql(f)
    with store.reader() as con:
        s = Session(con)
        _source, cats = op_categories(s, run_id)
        base = "FROM trace_events WHERE run_id = ? AND list_contains(?, category) AND name = ?"
        params: list[Any] = [run_id, cats, name, *cparams]
        summary = s.one(
            "op_summary",
            f"""
            SELECT count(*) AS calls, coalesce(sum(self_ns), 0) AS self_ns,
                   coalesce(sum(dur_ns), 0) AS total_ns,
                   min(self_ns) AS min_self_ns, quantile_disc(self_ns, 0.5) AS median_self_ns,
                   quantile_disc(self_ns, 0.95) AS p95_self_ns, max(self_ns) AS max_self_ns
            {base}{cond}
            """,
            params,
        )
        shapes = s.rows(
            "op_shapes",
            f"SELECT shapes, dtypes, count(*) AS calls, sum(self_ns) AS self_ns {base}{cond} "
            "GROUP BY shapes, dtypes ORDER BY self_ns DESC LIMIT 20",
            params,
        )
        places = s.rows(
            "op_places",
            f"SELECT module, phase, source_loc, count(*) AS calls, sum(self_ns) AS self_ns {base}{cond} "
            "GROUP BY module, phase, source_loc ORDER BY self_ns DESC LIMIT 20",
            params,
        )
        # Log-spaced bins (10 per decade) so one chart shows microsecond and second calls alike.
        histogram = s.rows(
            "op_histogram",
            f"""
            SELECT floor(log10(greatest(self_ns, 1)) * 10) / 10 AS log10_ns, count(*) AS calls
            {base}{cond} GROUP BY 1 ORDER BY 1
            """,
            params,
        )
        per_step = s.rows(
            "op_per_step",
            f"SELECT step, count(*) AS calls, sum(self_ns) AS self_ns {base}{cond} AND step IS NOT NULL "
            "GROUP BY step ORDER BY step LIMIT 5000",
            params,
        )
        return OpDetail(name, summary, shapes, places, histogram, per_step, s.timings)


@dataclass
class StepTimeline:
    step: int
    start_ns: int
    dur_ns: int
    events: list[dict[str, Any]]
    shown: int
    total: int
    timings: dict[str, float] = field(default_factory=dict)


def load_step_timeline(store: Store, run_id: str, step: int, limit: int = 2000) -> StepTimeline | None:
    """The longest events inside one step's time window (all threads), for a Gantt view."""
    with store.reader() as con:
        s = Session(con)
        window = s.one(
            "step_window",
            "SELECT start_ns, dur_ns FROM steps WHERE run_id = ? AND step = ? LIMIT 1",
            [run_id, step],
        )
        if not window:
            return None
        lo, hi = int(window["start_ns"]), int(window["start_ns"]) + int(window["dur_ns"])
        where = "FROM trace_events WHERE run_id = ? AND start_ns >= ? AND start_ns < ? AND category != 'Trace'"
        params: list[Any] = [run_id, lo, hi]
        total = s.one("timeline_count", f"SELECT count(*) AS n {where}", params)["n"]
        events = s.rows(
            "timeline",
            f"""
            SELECT process, thread, name, category, module, depth, on_device,
                   start_ns - ? AS offset_ns, dur_ns, self_ns
            {where} ORDER BY dur_ns DESC LIMIT ?
            """,
            [lo, *params, limit],
        )
        return StepTimeline(step, lo, hi - lo, events, len(events), int(total), s.timings)
