"""Compile and cache events (the Compilation page)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpudiag.store.dashboard_queries.session import COMPILE_KINDS, Session, has_column
from tpudiag.store.database import Store


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
        s = Session(con)
        failed = has_column(s, "compile_events", "failed")
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
