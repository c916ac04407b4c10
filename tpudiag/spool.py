"""Spooling: collectors write Parquet parts to the run folder while the script runs.

A part is written to a temporary name and renamed into place, so a part is either whole or absent, whatever kills
the process.  The capture loads finished parts into the store in short transactions (see store.ingest_spool).

Tables: the built-in record types of ``tpudiag.model``, plus any a collector declares (``Collector.tables``,
registered with ``model.register_table`` when the collector is loaded).  One folder per table, one part per write.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpudiag import forks
from tpudiag.model import arrow_schema, bulk_tables, records_to_arrow

if TYPE_CHECKING:  # Arrow loads on the first part written, not with the capture (~0.2 s before the script)
    import pyarrow as pa


class Spool:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def write_table(self, table: str, data: pa.Table, part: str | None = None) -> Path | None:
        """Spool ``data`` as one part of ``table``.  ``part`` names it (work that may run twice, e.g. a store write
        retried after its process died, writes the same part again instead of a second copy).  Nothing in a child
        forked from the capturing process (``tpudiag.forks``): its work is not the run's."""
        if forks.in_child():
            return None
        record = bulk_tables().get(table)
        if record is None:
            raise ValueError(f"unknown table {table!r} (a collector declares its own in Collector.tables)")
        if data.num_rows == 0:
            return None
        data = data.cast(arrow_schema(record))
        if part is None:
            with self._lock:
                part = f"{os.getpid()}-{next(self._counter):06d}"
        folder = self.directory / table
        folder.mkdir(parents=True, exist_ok=True)
        return write_parquet(data, folder / f"{part}.parquet")

    def write_records(self, cls: type[Any], records: list[Any]) -> Path | None:
        if not records:
            return None
        return self.write_table(cls.TABLE, records_to_arrow(cls, records))


def write_parquet(data: pa.Table, final: Path) -> Path:
    """Write ``data`` to ``final`` atomically: a reader sees the whole file or none (a hidden temporary file in
    the same folder, then a rename)."""
    import pyarrow.parquet as pq

    tmp = final.parent / f".{final.name}.tmp"
    pq.write_table(data, tmp, compression="zstd")
    os.replace(tmp, final)
    return final
