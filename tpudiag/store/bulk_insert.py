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
    data = data.select(arrow_schema(BULK_TABLES[table]).names).cast(_target(data.schema, table))
    view = f"tpudiag_bulk_{next(_names)}"
    con.register(view, data)
    # One DuckDB thread: the order-preserving insert from Arrow gained no wall time from a second thread here but
    # cost ~0.7 CPU-s more per million trace events (2 cores; same rows, same order).
    threads = con.execute("SELECT current_setting('threads')").fetchall()[0][0]
    con.execute("SET threads = 1")
    try:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {view}")
    finally:
        con.execute(f"SET threads = {int(threads)}")
        con.unregister(view)
    rows: int = data.num_rows
    return rows


def _target(have: pa.Schema, table: str) -> pa.Schema:
    """The table's Arrow schema, keeping dictionary-encoded string columns encoded (DuckDB ingests them faster)."""
    fields = []
    for f in arrow_schema(BULK_TABLES[table]):
        got = have.field(f.name).type
        keep = pa.types.is_dictionary(got) and got.value_type == f.type
        fields.append(pa.field(f.name, got, f.nullable) if keep else f)
    return pa.schema(fields)
