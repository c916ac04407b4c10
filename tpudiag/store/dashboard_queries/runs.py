"""Run list and per-run headline figures (the Runs page)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpudiag.store.dashboard_queries.session import COMPILE_KINDS, FAIL_VERDICTS, Session
from tpudiag.store.database import Store, decode_run
from tpudiag.store.queries import DEVICE_OP_CATEGORIES, HOST_OP_CATEGORIES


def list_run_choices(store: Store) -> list[dict[str, Any]]:
    """Every run's id, name, status and start time, newest first (the run pickers)."""
    with store.reader() as con:
        return Session(con).rows(
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
        s = Session(con)
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


def _add_headlines(s: Session, runs: list[dict[str, Any]], ids: list[str]) -> None:
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
