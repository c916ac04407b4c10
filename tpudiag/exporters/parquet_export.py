"""Parquet export: each table of one run as ``<out>/<table>.parquet``, readable by DuckDB, pandas and Spark.

Every file carries key-value metadata: ``tpudiag.schema_version`` (the store schema it was written from),
``tpudiag.table``, ``tpudiag.run_id`` and ``tpudiag.version``, so a reader can tell which schema it holds.
Rows stream from DuckDB as Arrow record batches straight into the Parquet writer (no Python rows).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tpudiag.atomic_file import atomic_file
from tpudiag.exporters import ExportOptions
from tpudiag.progress import Progress
from tpudiag.store import SCHEMA_VERSION, Store
from tpudiag.store import export_queries as q
from tpudiag.version import __version__

METADATA_PREFIX = "tpudiag."


def file_metadata(table: str, run_id: str) -> dict[bytes, bytes]:
    values = {
        "schema_version": str(SCHEMA_VERSION),
        "table": table,
        "run_id": run_id,
        "version": __version__,
    }
    return {f"{METADATA_PREFIX}{k}".encode(): v.encode() for k, v in values.items()}


class ParquetExporter:
    name = "parquet"
    description = "the run's tables as Parquet files (DuckDB, pandas, Spark), schema version in file metadata"

    def export(self, store: Store, run: dict[str, Any], out_dir: Path, options: ExportOptions) -> list[Path]:
        written: list[Path] = []
        with store.reader() as con:
            total = sum(q.count_rows(con, t, run["id"]) for t in q.RUN_TABLES)
            progress = Progress(f"export parquet {run['id']}", total)
            for table in q.RUN_TABLES:
                path = out_dir / f"{table}.parquet"
                reader = q.table_batches(con, table, run["id"])
                schema = reader.schema.with_metadata(file_metadata(table, run["id"]))
                with atomic_file(path) as fh, pq.ParquetWriter(fh, schema, compression="zstd") as writer:
                    for batch in reader:
                        writer.write_table(pa.Table.from_batches([batch], schema=schema))
                        progress.advance(batch.num_rows)
                written.append(path)
            written += _rank_partitions(con, run["id"], out_dir)
        progress.finish()
        return written


def _rank_partitions(con: Any, run_id: str, out_dir: Path) -> list[Path]:
    """A distributed run's per-rank tables, also in the shards' hive layout under ``<out>/shards/``."""
    import shutil

    from tpudiag.store import distributed_queries

    final, tmp = out_dir / "shards", out_dir / f".shards.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    files = distributed_queries.export_partitions(con, run_id, tmp)
    if not files:
        shutil.rmtree(tmp, ignore_errors=True)
        return []
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # whole or absent, like every exported file
    return [final / p.relative_to(tmp) for p in files]


def read_schema_version(path: Path) -> int | None:
    """The store schema version a tpudiag Parquet file was written from (None if it is not ours)."""
    meta = pq.read_schema(path).metadata or {}
    raw = meta.get(f"{METADATA_PREFIX}schema_version".encode())
    return int(raw) if raw is not None else None
