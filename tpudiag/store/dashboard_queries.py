"""Read queries behind the dashboard pages.

Each ``load_*`` function opens one short read-only connection (``Store.reader`` retries while a capture
writes), runs every query a page needs, closes it and returns plain Python values, so no connection outlives a
page run.  Aggregation happens in DuckDB: a page never loads a table, only the rows it shows.  Filters are
parameters; the only SQL text chosen at run time comes from fixed fragments in this module.  Each view records
how long each query took (``timings``, milliseconds), which the benchmark reads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import duckdb

from tpudiag.store.database import Store, decode_run
from tpudiag.store.queries import DEVICE_OP_CATEGORIES, HOST_OP_CATEGORIES

FAIL_VERDICTS = ("fail", "overflow")
BREAKDOWN_OPS = 8  # ops stacked in the per-step chart
MAX_STEP_BARS = 250
GROUPINGS = ("op", "op_module", "module")
PHASES = ("forward", "backward")


@dataclass(frozen=True)
class OpFilter:
    """Filters of the slow-ops page; each one narrows the events counted."""

    phase: str | None = None  # "forward" | "backward" | None for all
    name_contains: str | None = None
    module: str | None = None  # a module path: the module and everything below it
    step: int | None = None


class _Session:
    """One read-only connection plus per-query timings."""

    def __init__(self, con: duckdb.DuckDBPyConnection) -> None:
        self.con = con
        self.timings: dict[str, float] = {}

    def rows(self, label: str, sql: str, params: list[Any]) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        cur = self.con.execute(sql, params)
        cols = [d[0] for d in cur.description or []]
        out = [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]
        self.timings[label] = self.timings.get(label, 0.0) + (time.perf_counter() - t0) * 1e3
        return out

    def one(self, label: str, sql: str, params: list[Any]) -> dict[str, Any]:
        rows = self.rows(label, sql, params)
        return rows[0] if rows else {}


def _op_categories(s: _Session, run_id: str) -> tuple[str, list[str]]:
    """("device", device categories) when the run has device events, else ("host", host categories)."""
    row = s.one("time_source", "SELECT 1 AS yes FROM trace_events WHERE run_id = ? AND on_device LIMIT 1", [run_id])
    if row:
        return "device", list(DEVICE_OP_CATEGORIES)
    return "host", list(HOST_OP_CATEGORIES)


def _filter_sql(f: OpFilter) -> tuple[str, list[Any]]:
    sql, params = "", list[Any]()
    if f.phase:
        sql += " AND phase = ?"
        params.append(f.phase)
    if f.name_contains:
        sql += " AND contains(lower(name), lower(?))"
        params.append(f.name_contains)
    if f.module:
        sql += " AND (module = ? OR starts_with(module, ?))"
        params += [f.module, f.module + "."]
    if f.step is not None:
        sql += " AND step = ?"
        params.append(f.step)
    return sql, params


COMPILE_KINDS = ("compile", "recompile", "backward_compile")


def _has_column(s: _Session, table: str, column: str) -> bool:
    """Whether a table has a column (collectors are still growing their tables: tolerate both shapes)."""
    return bool(
        s.one(
            "columns",
            "SELECT 1 AS yes FROM information_schema.columns WHERE table_name = ? AND column_name = ?",
            [table, column],
        )
    )


# -- runs ----------------------------------------------------------------------------------------------------
def list_run_choices(store: Store) -> list[dict[str, Any]]:
    """Every run's id, name, status and start time, newest first (the run pickers)."""
    with store.reader() as con:
        return _Session(con).rows(
            "runs",
            "SELECT id, name, status, started_at, device_kind FROM runs ORDER BY started_at DESC, id DESC",
            [],
        )


@dataclass
class RunsView:
    runs: list[dict[str, Any]]
    total: int
    timings: dict[str, float] = field(default_factory=dict)


def load_runs(store: Store, search: str | None = None, statuses: list[str] | None = None, limit: int = 200) -> RunsView:
    """Runs matching the filters, newest first, each with its headline numbers."""
    with store.reader() as con:
        s = _Session(con)
        where, params = "WHERE 1 = 1", list[Any]()
        if search:
            where += (
                " AND (contains(lower(id), lower(?)) OR contains(lower(name), lower(?))"
                " OR contains(lower(coalesce(script, '')), lower(?)))"
            )
            params += [search] * 3
        if statuses:
            where += " AND list_contains(?, status)"
            params.append(statuses)
        total = s.one("count", f"SELECT count(*) AS n FROM runs {where}", params)["n"]
        runs = [
            decode_run(r)
            for r in s.rows(
                "runs",
                f"SELECT * FROM runs {where} ORDER BY started_at DESC, id DESC LIMIT ?",
                [*params, limit],
            )
        ]
        ids = [r["id"] for r in runs]
        if ids:
            _add_headlines(s, runs, ids)
        return RunsView(runs=runs, total=int(total), timings=s.timings)


def _add_headlines(s: _Session, runs: list[dict[str, Any]], ids: list[str]) -> None:
    slowest = s.rows(
        "headline_ops",
        """
        WITH summ AS (  -- finished runs: their op_summary rows
            SELECT run_id, name, category, on_device, calls, self_ns FROM op_summary WHERE list_contains(?, run_id)
        ), rows AS (
            SELECT * FROM summ
            UNION ALL  -- runs still being captured: their raw events
            SELECT run_id, name, category, on_device, 1 AS calls, self_ns FROM trace_events
            WHERE list_contains(?, run_id) AND run_id NOT IN (SELECT DISTINCT run_id FROM summ)
        ), src AS (
            SELECT run_id, bool_or(on_device) AS device, sum(calls) AS events FROM rows GROUP BY run_id
        ), agg AS (
            SELECT e.run_id, e.name, sum(e.self_ns) AS self_ns
            FROM rows e JOIN src USING (run_id)
            WHERE list_contains(CASE WHEN src.device THEN ? ELSE ? END, e.category)
            GROUP BY e.run_id, e.name
        )
        SELECT src.run_id, src.events, src.device, arg_max(agg.name, agg.self_ns) AS slowest_op,
               max(agg.self_ns) AS slowest_self_ns
        FROM src LEFT JOIN agg USING (run_id) GROUP BY src.run_id, src.events, src.device
        """,
        [ids, ids, list(DEVICE_OP_CATEGORIES), list(HOST_OP_CATEGORIES)],
    )
    divergences = s.rows(
        "headline_numerics",
        """
        WITH first AS (
            SELECT run_id, min(seq) AS seq FROM op_diffs
            WHERE list_contains(?, run_id) AND list_contains(?, verdict) GROUP BY run_id
        ), counted AS (
            SELECT run_id, count(*) AS ops_seen, count(*) FILTER (WHERE checked) AS ops_checked
            FROM ops WHERE list_contains(?, run_id) GROUP BY run_id
        )
        SELECT coalesce(counted.run_id, first.run_id) AS run_id, counted.ops_seen, counted.ops_checked,
               first.seq AS first_divergence_seq, o.op AS first_divergence_op,
               o.module AS first_divergence_module
        FROM counted FULL JOIN first USING (run_id)
        LEFT JOIN ops o ON o.run_id = first.run_id AND o.seq = first.seq
        """,
        [ids, list(FAIL_VERDICTS), ids],
    )
    compiles = s.rows(
        "headline_compile",
        """
        SELECT run_id, count(*) FILTER (WHERE kind = 'recompile') AS recompiles,
               count(*) FILTER (WHERE list_contains(?, kind)) AS compiles,
               sum(duration_s) FILTER (WHERE list_contains(?, kind)) AS compile_s
        FROM compile_events WHERE list_contains(?, run_id) GROUP BY run_id
        """,
        [list(COMPILE_KINDS), list(COMPILE_KINDS), ids],
    )
    extra: dict[str, dict[str, Any]] = {rid: {} for rid in ids}
    for group in (slowest, divergences, compiles):
        for row in group:
            extra[row.pop("run_id")].update(row)
    for run in runs:
        run.update(extra[run["id"]])


# -- slow ops ------------------------------------------------------------------------------------------------
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
    cond, cparams = _filter_sql(f)
    with store.reader() as con:
        s = _Session(con)
        source, cats = _op_categories(s, run_id)
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
    cond, cparams = _filter_sql(f)
    width = max(1, -(-steps // MAX_STEP_BARS))
    with store.reader() as con:
        s = _Session(con)
        _source, cats = _op_categories(s, run_id)
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
    cond, cparams = _filter_sql(f)
    with store.reader() as con:
        s = _Session(con)
        _source, cats = _op_categories(s, run_id)
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
        s = _Session(con)
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


# -- numerics ------------------------------------------------------------------------------------------------
_OP_COLUMNS = "d.seq, o.op, o.overload, o.module, o.phase, o.source_loc, o.step, o.dtypes, o.shapes, o.device"


@dataclass
class NumericsView:
    coverage: dict[str, Any]
    skipped: list[dict[str, Any]]
    verdicts: list[dict[str, Any]]
    first_divergence: dict[str, Any] | None
    series: list[dict[str, Any]]
    series_bucketed: bool
    marked: list[dict[str, Any]]
    modules: list[dict[str, Any]]
    divergent: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)


def load_numerics(store: Store, run_id: str, max_points: int = 4000, module: str | None = None) -> NumericsView:
    """Coverage, the first divergent op, error along the run, the per-module roll-up and the divergent ops."""
    with store.reader() as con:
        s = _Session(con)
        coverage = s.one(
            "coverage",
            """
            SELECT count(*) AS ops_seen, count(*) FILTER (WHERE checked) AS ops_checked,
                   count(*) FILTER (WHERE NOT checked) AS ops_skipped,
                   coalesce(sum(flops) FILTER (WHERE checked), 0) AS flops_checked,
                   coalesce(sum(flops), 0) AS flops_seen
            FROM ops WHERE run_id = ?
            """,
            [run_id],
        )
        skipped = s.rows(
            "skipped",
            "SELECT coalesce(skip_reason, '(no reason recorded)') AS reason, count(*) AS ops FROM ops "
            "WHERE run_id = ? AND NOT checked GROUP BY 1 ORDER BY ops DESC, reason",
            [run_id],
        )
        verdicts = s.rows(
            "verdicts",
            "SELECT verdict, count(*) AS outputs, count(*) FILTER (WHERE role = 'originator') AS originators "
            "FROM op_diffs WHERE run_id = ? GROUP BY verdict ORDER BY outputs DESC",
            [run_id],
        )
        first = s.rows(
            "first_divergence",
            f"""
            SELECT {_OP_COLUMNS}, d.output_index, d.verdict, d.role, d.dtype, d.scaled_error, d.max_abs,
                   d.max_rel, d.max_ulp, d.note
            FROM op_diffs d LEFT JOIN ops o ON o.run_id = d.run_id AND o.seq = d.seq
            WHERE d.run_id = ? AND list_contains(?, d.verdict)
            ORDER BY d.seq, d.scaled_error DESC NULLS LAST LIMIT 1
            """,
            [run_id, list(FAIL_VERDICTS)],
        )
        mod_cond, mod_params = (
            ("", []) if module is None else (" AND (o.module = ? OR starts_with(o.module, ?))", [module, module + "."])
        )
        n = s.one(
            "series_count",
            f"SELECT count(DISTINCT d.seq) AS n FROM op_diffs d LEFT JOIN ops o ON o.run_id = d.run_id "
            f"AND o.seq = d.seq WHERE d.run_id = ? AND d.scaled_error IS NOT NULL{mod_cond}",
            [run_id, *mod_params],
        )["n"]
        # Past max_points ops, keep the worst op of each bucket of consecutive ops (the peaks stay visible).
        width = max(1, -(-int(n) // max_points))
        series = s.rows(
            "series",
            f"""
            WITH per_op AS (
                SELECT d.seq, max(d.scaled_error) AS error, bool_or(list_contains(?, d.verdict)) AS failed,
                       bool_or(d.role = 'originator') AS originator, any_value(o.op) AS op,
                       any_value(o.module) AS module
                FROM op_diffs d LEFT JOIN ops o ON o.run_id = d.run_id AND o.seq = d.seq
                WHERE d.run_id = ? AND d.scaled_error IS NOT NULL{mod_cond}
                GROUP BY d.seq
            )
            SELECT arg_max(seq, error) AS seq, max(error) AS error, bool_or(failed) AS failed,
                   bool_or(originator) AS originator, arg_max(op, error) AS op,
                   arg_max(module, error) AS module
            FROM per_op GROUP BY seq // ? ORDER BY seq
            """,
            [list(FAIL_VERDICTS), run_id, *mod_params, width],
        )
        marked = s.rows(
            "marked",
            f"""
            SELECT d.seq, max(d.scaled_error) AS error, any_value(o.op) AS op, any_value(o.module) AS module,
                   bool_or(d.role = 'originator') AS originator,
                   bool_or(list_contains(?, d.verdict)) AS failed
            FROM op_diffs d LEFT JOIN ops o ON o.run_id = d.run_id AND o.seq = d.seq
            WHERE d.run_id = ? AND (d.role = 'originator' OR list_contains(?, d.verdict)){mod_cond}
            GROUP BY d.seq ORDER BY d.seq LIMIT 2000
            """,
            [list(FAIL_VERDICTS), run_id, list(FAIL_VERDICTS), *mod_params],
        )
        modules = s.rows(
            "module_rollup",
            """
            WITH per_op AS (
                SELECT o.module, o.seq, o.checked, max(d.scaled_error) AS error,
                       bool_or(list_contains(?, d.verdict)) AS failed,
                       bool_or(d.role = 'originator') AS originator
                FROM ops o LEFT JOIN op_diffs d ON d.run_id = o.run_id AND d.seq = o.seq
                WHERE o.run_id = ? GROUP BY o.module, o.seq, o.checked
            )
            SELECT coalesce(module, '(no module)') AS module, count(*) AS ops,
                   count(*) FILTER (WHERE checked) AS checked, count(*) FILTER (WHERE failed) AS divergent,
                   count(*) FILTER (WHERE originator) AS originators, max(error) AS max_error,
                   min(seq) FILTER (WHERE failed) AS first_divergent_seq
            FROM per_op GROUP BY module
            ORDER BY divergent DESC, max_error DESC NULLS LAST, module LIMIT 500
            """,
            [list(FAIL_VERDICTS), run_id],
        )
        divergent = s.rows(
            "divergent",
            f"""
            SELECT {_OP_COLUMNS}, max(d.scaled_error) AS error,
                   string_agg(DISTINCT d.verdict, ',') AS verdicts,
                   bool_or(d.role = 'originator') AS originator, any_value(d.role) AS role
            FROM op_diffs d LEFT JOIN ops o ON o.run_id = d.run_id AND o.seq = d.seq
            WHERE d.run_id = ? AND (list_contains(?, d.verdict) OR d.role = 'originator')
            GROUP BY ALL ORDER BY d.seq LIMIT 1000
            """,
            [run_id, list(FAIL_VERDICTS)],
        )
        return NumericsView(
            coverage,
            skipped,
            verdicts,
            first[0] if first else None,
            series,
            width > 1,
            marked,
            modules,
            divergent,
            s.timings,
        )


def load_op_diffs(store: Store, run_id: str, seq: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One op (its ``ops`` row, or {} when not recorded) and every output's metrics."""
    with store.reader() as con:
        s = _Session(con)
        op = s.one("op", "SELECT * FROM ops WHERE run_id = ? AND seq = ?", [run_id, seq])
        diffs = s.rows(
            "op_diffs",
            "SELECT * FROM op_diffs WHERE run_id = ? AND seq = ? ORDER BY output_index",
            [run_id, seq],
        )
        return op, diffs


# -- compile -------------------------------------------------------------------------------------------------
@dataclass
class CompileView:
    kinds: list[dict[str, Any]]
    cache: list[dict[str, Any]]
    frames: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    reasons: list[dict[str, Any]]
    origin_ns: int | None
    timings: dict[str, float] = field(default_factory=dict)


def load_compile(store: Store, run_id: str, kinds: list[str] | None = None, limit: int = 5000) -> CompileView:
    """Events by kind, cache hit rate by tier, the frames that recompile most, the timeline, the reasons."""
    with store.reader() as con:
        s = _Session(con)
        failed = _has_column(s, "compile_events", "failed")
        by_kind = s.rows(
            "kinds",
            "SELECT kind, count(*) AS events, coalesce(sum(duration_s), 0) AS duration_s, "
            f"count(*) FILTER (WHERE {'failed' if failed else 'false'}) AS failed "
            "FROM compile_events WHERE run_id = ? GROUP BY kind ORDER BY events DESC, kind",
            [run_id],
        )
        cache = s.rows(
            "cache",
            """
            SELECT coalesce(cache_tier, '(unnamed cache)') AS tier, count(*) FILTER (WHERE cache_hit) AS hits,
                   count(*) FILTER (WHERE NOT cache_hit) AS misses
            FROM compile_events WHERE run_id = ? AND cache_hit IS NOT NULL GROUP BY 1 ORDER BY 1
            """,
            [run_id],
        )
        frames = s.rows(
            "frames",
            """
            SELECT function, file, line,
                   count(*) FILTER (WHERE list_contains(?, kind)) AS compiles,
                   count(*) FILTER (WHERE kind = 'recompile') AS recompiles,
                   count(*) FILTER (WHERE kind = 'graph_break') AS graph_breaks,
                   coalesce(sum(duration_s) FILTER (WHERE list_contains(?, kind)), 0) AS compile_s,
                   coalesce(sum(duration_s) FILTER (WHERE kind = 'recompile'), 0) AS recompile_s,
                   list(DISTINCT reason ORDER BY reason) FILTER (WHERE reason IS NOT NULL) AS reasons
            FROM compile_events WHERE run_id = ? AND (function IS NOT NULL OR file IS NOT NULL)
            GROUP BY function, file, line
            ORDER BY recompiles DESC, compile_s DESC, function LIMIT 50
            """,
            [list(COMPILE_KINDS), list(COMPILE_KINDS), run_id],
        )
        kind_cond, kind_params = ("", []) if not kinds else (" AND list_contains(?, kind)", [kinds])
        origin = s.one(
            "origin",
            "SELECT coalesce(min(ts_ns), CAST(any_value(r.started_at) * 1e9 AS BIGINT)) AS origin "
            "FROM compile_events c, runs r WHERE c.run_id = ? AND r.id = ?",
            [run_id, run_id],
        ).get("origin")
        timeline = s.rows(
            "timeline",
            f"""
            SELECT seq, kind, ts_ns, function, file, line, cache_tier, cache_hit, reason, duration_s, shapes
            FROM compile_events WHERE run_id = ?{kind_cond}
            ORDER BY ts_ns NULLS LAST, seq LIMIT ?
            """,
            [run_id, *kind_params, limit],
        )
        reasons = s.rows(
            "reasons",
            "SELECT kind, reason, count(*) AS events, coalesce(sum(duration_s), 0) AS duration_s "
            "FROM compile_events WHERE run_id = ? AND reason IS NOT NULL GROUP BY kind, reason "
            "ORDER BY events DESC, duration_s DESC LIMIT 100",
            [run_id],
        )
        return CompileView(by_kind, cache, frames, timeline, reasons, origin, s.timings)


# -- compare -------------------------------------------------------------------------------------------------
@dataclass
class CompareView:
    runs: dict[str, dict[str, Any]]  # "a" / "b" -> run row with headline numbers
    ops: list[dict[str, Any]]
    numerics: list[dict[str, Any]]
    compile: list[dict[str, Any]]
    timings: dict[str, float] = field(default_factory=dict)


def load_compare(store: Store, run_a: str, run_b: str, limit: int = 30) -> CompareView:
    """Two runs side by side: op self-time deltas, divergence changes per op and module, compile counts."""
    with store.reader() as con:
        s = _Session(con)
        runs: dict[str, dict[str, Any]] = {}
        cats: dict[str, list[str]] = {}
        for key, rid in (("a", run_a), ("b", run_b)):
            row = s.one("run", "SELECT * FROM runs WHERE id = ?", [rid])
            source, cats[key] = _op_categories(s, rid)
            stats = s.one(
                "run_stats",
                "SELECT count(*) AS steps, quantile_cont(dur_ns, 0.5) AS median_step_ns, "
                "sum(dur_ns) AS steps_ns FROM steps WHERE run_id = ?",
                [rid],
            )
            total = s.one(
                "run_total",
                "SELECT coalesce(sum(self_ns), 0) AS op_self_ns, count(*) AS op_events FROM trace_events "
                "WHERE run_id = ? AND list_contains(?, category)",
                [rid, cats[key]],
            )
            runs[key] = {**decode_run(row), **stats, **total, "time_source": source} if row else {}
        ops = s.rows(
            "compare_ops",
            """
            WITH a AS (SELECT name, count(*) AS calls, sum(self_ns) AS self_ns FROM trace_events
                       WHERE run_id = ? AND list_contains(?, category) GROUP BY name),
                 b AS (SELECT name, count(*) AS calls, sum(self_ns) AS self_ns FROM trace_events
                       WHERE run_id = ? AND list_contains(?, category) GROUP BY name)
            SELECT name, coalesce(a.calls, 0) AS calls_a, coalesce(b.calls, 0) AS calls_b,
                   coalesce(a.self_ns, 0) AS self_ns_a, coalesce(b.self_ns, 0) AS self_ns_b,
                   coalesce(b.self_ns, 0) - coalesce(a.self_ns, 0) AS delta_ns
            FROM a FULL JOIN b USING (name)
            ORDER BY abs(coalesce(b.self_ns, 0) - coalesce(a.self_ns, 0)) DESC, name LIMIT ?
            """,
            [run_a, cats["a"], run_b, cats["b"], limit],
        )
        numerics = s.rows(
            "compare_numerics",
            """
            WITH per AS (
                SELECT d.run_id, o.op, o.module, count(DISTINCT d.seq) AS checked,
                       count(DISTINCT d.seq) FILTER (WHERE list_contains(?, d.verdict)) AS divergent,
                       max(d.scaled_error) AS max_error
                FROM op_diffs d LEFT JOIN ops o ON o.run_id = d.run_id AND o.seq = d.seq
                WHERE d.run_id IN (?, ?) GROUP BY ALL
            ), a AS (SELECT * FROM per WHERE run_id = ?), b AS (SELECT * FROM per WHERE run_id = ?)
            SELECT coalesce(a.op, b.op) AS op, coalesce(a.module, b.module) AS module,
                   coalesce(a.divergent, 0) AS divergent_a, coalesce(b.divergent, 0) AS divergent_b,
                   a.max_error AS max_error_a, b.max_error AS max_error_b
            FROM a FULL JOIN b ON a.op IS NOT DISTINCT FROM b.op AND a.module IS NOT DISTINCT FROM b.module
            WHERE coalesce(a.divergent, 0) > 0 OR coalesce(b.divergent, 0) > 0
            ORDER BY abs(coalesce(b.divergent, 0) - coalesce(a.divergent, 0)) DESC, op LIMIT 200
            """,
            [list(FAIL_VERDICTS), run_a, run_b, run_a, run_b],
        )
        compile_rows = s.rows(
            "compare_compile",
            """
            SELECT kind, count(*) FILTER (WHERE run_id = ?) AS events_a,
                   count(*) FILTER (WHERE run_id = ?) AS events_b,
                   coalesce(sum(duration_s) FILTER (WHERE run_id = ?), 0) AS duration_s_a,
                   coalesce(sum(duration_s) FILTER (WHERE run_id = ?), 0) AS duration_s_b
            FROM compile_events WHERE run_id IN (?, ?) GROUP BY kind ORDER BY kind
            """,
            [run_a, run_b, run_a, run_b, run_a, run_b],
        )
        return CompareView(runs, ops, numerics, compile_rows, s.timings)
