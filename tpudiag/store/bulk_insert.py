"""Bulk insert of in-memory Arrow tables into the store, inside a caller's transaction.

The spool (Parquet parts, then ``INSERT ... FROM read_parquet``) bounds memory and survives crashes during a
capture.  An import already holds one file's rows as Arrow, so writing them straight from Arrow skips a Parquet
encode and decode (~0.8 s per million trace events on 2 cores).
"""

from __future__ import annotations

import itertools

import duckdb
import pyarrow as pa

from tpudiag.model import BULK_TABLES, arrow_schema

_names = itertools.count()


def insert_arrow(con: duckdb.DuckDBPyConnection, table: str, data: pa.Table) -> int:
    """Append ``data`` (cast to ``table``'s schema) to ``table``; returns the rows written."""
    if table not in BULK_TABLES:
        raise ValueError(f"unknown table {table!r}")
    if data.num_rows == 0:
        return 0
    data = data.cast(arrow_schema(BULK_TABLES[table]))
    view = f"tpudiag_bulk_{next(_names)}"
    con.register(view, data)
    try:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {view}")
    finally:
        con.unregister(view)
    rows: int = data.num_rows
    return rows
