"""What every dashboard query shares: the read session with timings, op filters, fixed SQL fragments."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tpudiag.store.queries import DEVICE_OP_CATEGORIES, HOST_OP_CATEGORIES

if TYPE_CHECKING:
    import duckdb

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


class Session:
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


def op_categories(s: Session, run_id: str) -> tuple[str, list[str]]:
    """("device", device categories) when the run has device events, else ("host", host categories)."""
    row = s.one("time_source", "SELECT 1 AS yes FROM trace_events WHERE run_id = ? AND on_device LIMIT 1", [run_id])
    if row:
        return "device", list(DEVICE_OP_CATEGORIES)
    return "host", list(HOST_OP_CATEGORIES)


def filter_sql(f: OpFilter) -> tuple[str, list[Any]]:
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


def has_column(s: Session, table: str, column: str) -> bool:
    """Whether a table has a column (collectors are still growing their tables: tolerate both shapes)."""
    return bool(
        s.one(
            "columns",
            "SELECT 1 AS yes FROM information_schema.columns WHERE table_name = ? AND column_name = ?",
            [table, column],
        )
    )
