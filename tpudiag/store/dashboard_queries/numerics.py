"""Numerics findings: divergent ops, error scatter, one op's diffs (the Numerics page)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpudiag.store.dashboard_queries.session import FAIL_VERDICTS, Session
from tpudiag.store.database import Store

_OP_COLUMNS = (
    "d.seq, o.op, o.overload, o.module, o.phase, o.source_loc, o.step, o.dtypes, o.shapes, o.device, "
    "o.region, o.graph_id, o.fx_node"
)


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
        s = Session(con)
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
        s = Session(con)
        op = s.one("op", "SELECT * FROM ops WHERE run_id = ? AND seq = ?", [run_id, seq])
        diffs = s.rows(
            "op_diffs",
            "SELECT * FROM op_diffs WHERE run_id = ? AND seq = ? ORDER BY output_index",
            [run_id, seq],
        )
        return op, diffs
