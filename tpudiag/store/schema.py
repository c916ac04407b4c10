"""The store's DDL, its version, and the migrations between versions.

Table columns come from the data model (tpudiag.model), so a column added to a record type is added here too.
Migrations are keyed by the version they upgrade *from*; a store written by a newer tpudiag is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tpudiag.model import BULK_TABLES, Run, column_kinds

SCHEMA_VERSION = 4

_DUCK_TYPES = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN", "str": "VARCHAR"}


def _create_table(name: str, cls: type[Any], primary_key: str | None = None) -> str:
    cols = [f'"{name}" {_DUCK_TYPES[kind]}' for name, kind in column_kinds(cls)]
    if primary_key:
        cols.append(f"PRIMARY KEY ({primary_key})")
    return f"CREATE TABLE IF NOT EXISTS {name} (" + ", ".join(cols) + ")"


def ddl() -> list[str]:
    stmts = [
        "CREATE TABLE IF NOT EXISTS meta (key VARCHAR PRIMARY KEY, value VARCHAR)",
        _create_table(Run.TABLE, Run, primary_key="id"),
        # Spool parts already loaded, so a part is never loaded twice (e.g. after a crash between commit and unlink).
        "CREATE TABLE IF NOT EXISTS ingested_parts "
        "(run_id VARCHAR, part VARCHAR, rows BIGINT, PRIMARY KEY (run_id, part))",
    ]
    stmts += [_create_table(name, cls) for name, cls in BULK_TABLES.items()]
    # Per-run aggregate of trace_events, written once when a run is finished, so the slow-ops views read a few
    # thousand rows instead of scanning millions of events (the dashboard's 200 ms budget on 10 M events).
    stmts.append(
        "CREATE TABLE IF NOT EXISTS op_summary (run_id VARCHAR, name VARCHAR, module VARCHAR, phase VARCHAR, "
        "category VARCHAR, on_device BOOLEAN, calls BIGINT, self_ns BIGINT, dur_ns BIGINT, max_self_ns BIGINT)"
    )
    return stmts


# version N -> callable(connection) that brings a version-N store to N+1.
def _v1_to_v2(con: Any) -> None:
    """Compiled-region numerics: which region an ops row is from, its graph and node; eager error of a graph."""
    con.execute("ALTER TABLE ops ADD COLUMN IF NOT EXISTS region VARCHAR DEFAULT 'eager_op'")
    con.execute("ALTER TABLE ops ADD COLUMN IF NOT EXISTS graph_id VARCHAR")
    con.execute("ALTER TABLE ops ADD COLUMN IF NOT EXISTS fx_node VARCHAR")
    con.execute("ALTER TABLE op_diffs ADD COLUMN IF NOT EXISTS ref_rmse DOUBLE")


def _v2_to_v3(con: Any) -> None:
    """The memory collector's tables (issue 22)."""
    from tpudiag.model import MEMORY_RECORDS

    for cls in MEMORY_RECORDS:
        con.execute(_create_table(cls.TABLE, cls))


def _v3_to_v4(con: Any) -> None:
    """Long runs (issue 21): the pulse and the trace windows, new tables."""
    from tpudiag.model import PulseStep, TraceWindow

    con.execute(_create_table(PulseStep.TABLE, PulseStep))
    con.execute(_create_table(TraceWindow.TABLE, TraceWindow))


MIGRATIONS: dict[int, Callable[[Any], None]] = {1: _v1_to_v2, 2: _v2_to_v3, 3: _v3_to_v4}
