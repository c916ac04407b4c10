"""Two runs side by side (the Compare page)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpudiag.store.dashboard_queries.session import FAIL_VERDICTS, Session, op_categories
from tpudiag.store.database import Store, decode_run


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
        s = Session(con)
        runs: dict[str, dict[str, Any]] = {}
        cats: dict[str, list[str]] = {}
        for key, rid in (("a", run_a), ("b", run_b)):
            row = s.one("run", "SELECT * FROM runs WHERE id = ?", [rid])
            source, cats[key] = op_categories(s, rid)
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
