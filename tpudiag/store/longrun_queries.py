"""Queries over the pulse and the trace windows of a run (issue 21); the report, the dashboard and the exporters
read them."""

from __future__ import annotations

from typing import Any

from tpudiag.store.database import Store

SLOW_FACTOR = 4.0  # a step this many times the run's median is listed as slow
MAX_SLOW_LISTED = 50
TOP_OPS = 5


def _dicts(cur: Any) -> list[dict[str, Any]]:
    cols = [d[0] for d in cur.description or []]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def pulse_summary(store: Store, run_id: str) -> dict[str, Any] | None:
    """Steps (of the rank that ran most), step-time percentiles, slow steps (over ``SLOW_FACTOR`` x the median),
    compile and non-finite counts (every rank's)."""
    with store.reader() as con:
        row = con.execute(
            "SELECT count(*), quantile_cont(dur_ns, 0.5), quantile_cont(dur_ns, 0.99), max(dur_ns), sum(dur_ns), "
            "sum(coalesce(gap_ns, 0)), sum(own_ns), sum(recompiles), sum(graph_breaks), "
            "count(*) FILTER (WHERE nonfinite), count(DISTINCT rank), "
            "(SELECT max(n) FROM (SELECT count(*) AS n FROM pulse WHERE run_id = ? GROUP BY rank)) "
            "FROM pulse WHERE run_id = ?",
            [run_id, run_id],
        ).fetchone()
        if row is None or not row[0]:
            return None
        _, p50, p99, longest, busy, gaps, own, recompiles, breaks, nonfinite, ranks, steps = row
        slow = _dicts(
            con.execute(
                "SELECT step, rank, dur_ns, window_id FROM pulse WHERE run_id = ? AND dur_ns > ? "
                "ORDER BY dur_ns DESC LIMIT ?",
                [run_id, SLOW_FACTOR * float(p50), MAX_SLOW_LISTED],
            )
        )
        longest_outside = con.execute(
            "SELECT max(own_ns) FROM pulse WHERE run_id = ? AND window_id IS NULL", [run_id]
        ).fetchone()
    return {
        "steps": int(steps),
        "ranks": int(ranks),
        "step_time_p50_s": round(float(p50) / 1e9, 6),
        "step_time_p99_s": round(float(p99) / 1e9, 6),
        "step_time_max_s": round(float(longest) / 1e9, 6),
        "steps_s": round(float(busy) / 1e9, 6),
        "gaps_s": round(float(gaps) / 1e9, 6),
        "tpudiag_s": round(float(own) / 1e9, 6),
        "tpudiag_max_outside_windows_s": round(float(longest_outside[0] or 0) / 1e9, 6) if longest_outside else None,
        "recompiles": int(recompiles or 0),
        "graph_breaks": int(breaks or 0),
        "nonfinite_steps": int(nonfinite or 0),
        "slow_steps": [
            {
                "step": int(s["step"]),
                "rank": int(s["rank"]),
                "dur_s": round(s["dur_ns"] / 1e9, 6),
                "window_id": s["window_id"],
            }
            for s in slow
        ],
    }


def step_times(store: Store, run_id: str, max_points: int = 20_000) -> list[dict[str, Any]]:
    """Every step's time (rank 0), thinned to ``max_points`` by keeping each bucket's slowest step."""
    with store.reader() as con:
        n = con.execute("SELECT count(*) FROM pulse WHERE run_id = ? AND rank = 0", [run_id]).fetchone()
        count = int(n[0]) if n else 0
        every = max(1, -(-count // max_points))
        return _dicts(
            con.execute(
                "SELECT arg_max(step, dur_ns) AS step, max(dur_ns) AS dur_ns, arg_max(start_ns, dur_ns) AS start_ns, "
                "arg_max(window_id, dur_ns) AS window_id FROM pulse WHERE run_id = ? AND rank = 0 "
                "GROUP BY step // ? ORDER BY 1",
                [run_id, every],
            )
        )


def windows(store: Store, run_id: str, top: int = TOP_OPS) -> list[dict[str, Any]]:
    """The run's trace windows, oldest first, each with its slowest host ops (self time)."""
    with store.reader() as con:
        rows = _dicts(
            con.execute(
                "SELECT window_id AS id, any_value(reason) AS reason, min(first_step) AS first_step, "
                "max(last_step) AS last_step, min(start_ns) AS start_ns, max(end_ns) AS end_ns, "
                "max(trace_events) AS trace_events, any_value(first_event_id) AS first_event_id, "
                "any_value(detail) AS detail, bool_or(numerics) AS numerics, bool_or(pruned) AS pruned, rank "
                "FROM trace_windows WHERE run_id = ? GROUP BY window_id, rank ORDER BY window_id, rank",
                [run_id],
            )
        )
        started = con.execute("SELECT started_at FROM runs WHERE id = ?", [run_id]).fetchone()
        t0 = float(started[0]) if started else 0.0
        for w in rows:
            first = int(w["first_event_id"])
            last = first + max(int(w["trace_events"]), 1)
            w["top_ops"] = _dicts(
                con.execute(
                    "SELECT name, count(*) AS calls, sum(self_ns) / 1e3 AS self_us FROM trace_events "
                    "WHERE run_id = ? AND event_id >= ? AND event_id < ? AND rank = ? AND category = 'cpu_op' "
                    "GROUP BY name ORDER BY self_us DESC LIMIT ?",
                    [run_id, first, last, w["rank"], top],
                )
            )
            w["start_s"] = round(w["start_ns"] / 1e9 - t0, 6)
            w["end_s"] = round(w["end_ns"] / 1e9 - t0, 6)
    return rows


def has_pulse(store: Store, run_id: str) -> bool:
    with store.reader() as con:
        row = con.execute("SELECT count(*) FROM pulse WHERE run_id = ?", [run_id]).fetchone()
        return bool(row and row[0])
