"""The report's step summary computed in SQL, so memory does not grow with the number of steps.

A merged distributed run holds every rank's steps (ranks x steps rows); bringing them all to Python as dicts cost
~700 bytes a step (34 MB at 256 ranks x 200 steps).  Here DuckDB sorts and aggregates; Python receives a fixed
number of values (the first step, the union of step intervals, the one or two middle durations of the median)
plus the first ``limit`` steps the report lists.  The result is the same as
``analysis.step_summary.summarize_steps`` over all the steps (a test checks it on edge cases): the same order
(start time, ties in rank then step order), the same float arithmetic on the same values.
"""

from __future__ import annotations

from typing import Any

from tpudiag.analysis.step_summary import no_steps
from tpudiag.store.database import Store
from tpudiag.store.step_queries import _TOOL_EVENTS, DISPATCH_WRAPPER, TOOL_CATEGORY, TOOL_RANGE_LIKE

# Steps in the report's order, each with its position by start time and tpudiag's own ns inside its step number
# (the same per-step-number total as ``step_queries.tool_ns_by_step``).
_STEPS = f"""
    WITH tool AS (
        SELECT s.step, sum(t.tool_ns) AS tool_ns FROM steps s JOIN ({_TOOL_EVENTS}) t
          ON t.start_ns >= s.start_ns AND t.start_ns < s.start_ns + s.dur_ns
        WHERE s.run_id = $run GROUP BY s.step
    )
    SELECT s.step, s.start_ns, s.dur_ns, s.kind, s.input_shapes, s.rank, coalesce(tool.tool_ns, 0) AS tool_ns,
           row_number() OVER (ORDER BY s.start_ns, s.rank, s.step) AS pos
    FROM steps s LEFT JOIN tool ON tool.step = s.step
    WHERE s.run_id = $run
"""
_DOUBLE_S = "CAST({} AS DOUBLE) / CAST(1000000000 AS DOUBLE)"

# Length of the union of the step intervals (gaps and islands: a step starts an island when it begins after every
# earlier interval ended).
_UNION = """
    WITH iv AS (
        SELECT start_ns AS lo, start_ns + dur_ns AS hi FROM steps WHERE run_id = $run
    ), marked AS (
        SELECT lo, hi, CASE WHEN lo > max(hi) OVER (ORDER BY lo, hi ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING)
                            THEN 1 ELSE 0 END AS starts
        FROM iv
    ), islands AS (
        SELECT lo, hi, sum(starts) OVER (ORDER BY lo, hi ROWS UNBOUNDED PRECEDING) AS island FROM marked
    )
    SELECT coalesce(sum(len), 0) FROM (SELECT max(hi) - min(lo) AS len FROM islands GROUP BY island)
"""


def _params(run_id: str) -> dict[str, Any]:
    return {"run": run_id, "tool": TOOL_RANGE_LIKE, "tool_cat": TOOL_CATEGORY, "wrapper": DISPATCH_WRAPPER}


def _median(con: Any, params: dict[str, Any], value_sql: str, n: int) -> float | None:
    """``statistics.median`` of ``value_sql`` over the steps after the first: only the middle values come back."""
    if n <= 0:
        return None
    lo, hi = (n - 1) // 2, n // 2
    rows = con.execute(
        f"SELECT v FROM (SELECT {value_sql} AS v FROM ({_STEPS}) WHERE pos > 1) ORDER BY v "
        f"LIMIT {hi - lo + 1} OFFSET {lo}",
        params,
    ).fetchall()
    vals = [float(r[0]) for r in rows]
    return vals[0] if n % 2 else (vals[0] + vals[1]) / 2


def summarize(
    store: Store,
    run_id: str,
    script_s: float | None,
    span_ns: tuple[int, int] | None,
    with_tool: bool,
    tool_total_ns: int | None,
    limit: int,
) -> tuple[dict[str, object], list[dict[str, Any]]]:
    """(the ``steps`` summary as ``summarize_steps`` gives it, the first ``limit`` steps in rank then step order
    with their ``tool_ns``)."""
    params = _params(run_id)
    with store.reader() as con:
        count = int(con.execute("SELECT count(*) FROM steps WHERE run_id = $run", {"run": run_id}).fetchone()[0])  # type: ignore[index]
        listed = [
            dict(zip(("step", "start_ns", "dur_ns", "kind", "input_shapes", "tool_ns"), row, strict=True))
            for row in con.execute(
                f"SELECT step, start_ns, dur_ns, kind, input_shapes, tool_ns FROM ({_STEPS}) "
                f"ORDER BY rank, step LIMIT {int(limit)}",
                params,
            ).fetchall()
        ]
        if not count:
            return no_steps(script_s, tool_total_ns), listed
        first_dur, first_kind = con.execute(f"SELECT dur_ns, kind FROM ({_STEPS}) WHERE pos = 1", params).fetchone()  # type: ignore[misc]
        covered = int(con.execute(_UNION, {"run": run_id}).fetchone()[0])  # type: ignore[index]
        steady = _median(con, params, _DOUBLE_S.format("dur_ns"), count - 1)
        out: dict[str, object] = {}
        if with_tool:
            own = 0.0
            cur = con.execute(f"SELECT tool_ns FROM ({_STEPS}) ORDER BY pos", params)
            while chunk := cur.fetchmany(10_000):  # summed in start order, as the float sum in Python is
                for (ns,) in chunk:
                    own += int(ns) / 1e9
            without = _median(con, params, f"{_DOUBLE_S.format('dur_ns')} - {_DOUBLE_S.format('tool_ns')}", count - 1)
            out = {
                "tpudiag_in_steps_s": round(own, 6),
                "tpudiag_s": round(tool_total_ns / 1e9, 6) if tool_total_ns is not None else round(own, 6),
                "steady_median_without_tpudiag_s": round(without, 6) if without is not None else None,
            }
    durs0 = int(first_dur) / 1e9
    outside = None
    if script_s is not None:
        outside = max(0.0, script_s - covered / 1e9)
    elif span_ns is not None:
        outside = max(0.0, (span_ns[1] - span_ns[0] - covered) / 1e9)
    summary: dict[str, object] = {
        "count": count,
        "first_s": round(durs0, 6),
        "steady_median_s": round(steady, 6) if steady is not None else None,
        "outside_steps_s": round(outside, 6) if outside is not None else None,
        "kind": first_kind,
        "steps_s": round(covered / 1e9, 6),
        "script_s": script_s,
        **out,
    }
    return summary, listed
