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
SINGLE_THREAD_STRING_BYTES = 32  # plain (not dictionary-coded) string bytes per row above which one thread inserts


def insert_arrow(con: duckdb.DuckDBPyConnection, table: str, data: pa.Table) -> int:
    """Append ``data`` (cast to ``table``'s schema) to ``table``; returns the rows written."""
    if table not in BULK_TABLES:
        raise ValueError(f"unknown table {table!r}")
    if data.num_rows == 0:
        return 0
    data = data.select(arrow_schema(BULK_TABLES[table]).names).cast(_target(data.schema, table))
    view = f"tpudiag_bulk_{next(_names)}"
    con.register(view, data)
    # DuckDB's parallel insert halves the wall time of numeric and dictionary-coded columns (1 M XPlane events:
    # 0.8 s vs 1.6 s on 2 cores) but gains nothing on long unique strings and costs more CPU (1 M Kineto events
    # with ~84 B of raw ``args`` JSON per row: 2.2 s either way, +0.6 CPU-s): those go in on one thread.
    threads = con.execute("SELECT current_setting('threads')").fetchall()[0][0]
    single = _plain_string_bytes(data) > SINGLE_THREAD_STRING_BYTES * data.num_rows
    if single:
        con.execute("SET threads = 1")
    try:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM {view}")
    finally:
        if single:
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


def _plain_string_bytes(data: pa.Table) -> int:
    return sum(c.nbytes for c, f in zip(data.columns, data.schema, strict=True) if pa.types.is_string(f.type))
