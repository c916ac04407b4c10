"""Per-rank shards: Parquet parts in a hive layout, ``<root>/<table>/run_id=<id>/rank=<r>/<part>.parquet``.

Every rank of a job writes its own parts, so ranks never share a file or a lock, and the tree is one table per
folder for DuckDB (``read_parquet('<root>/<table>/*/*/*.parquet', hive_partitioning = true)``), Spark (partition
discovery) and BigQuery external tables alike.  ``run_id`` and ``rank`` live only in the folder names (a column
repeated in the files would clash with the partition column in Spark); ``restart`` (torchelastic's restart count)
is a column, so a restarted job keeps every attempt side by side.

A part is written under a temporary name and renamed, so it is whole or absent whatever kills the rank.  A rank
that does not know its number yet (``torch.multiprocessing.spawn`` before ``init_process_group``) writes to a
staging folder; ``set_rank`` moves those parts into place.
"""

from __future__ import annotations

import itertools
import os
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpudiag.distributed.records import DIST_RECORDS
from tpudiag.model import arrow_schema, bulk_tables, records_to_arrow
from tpudiag.spool import Spool, write_parquet

if TYPE_CHECKING:  # Arrow loads with the first shard, not with every capture (the spawn wrapper imports this)
    import pyarrow as pa

PATH_COLUMNS = ("run_id", "rank")
DIST_TABLES: dict[str, type[Any]] = {c.TABLE: c for c in DIST_RECORDS}


def shard_tables() -> dict[str, type[Any]]:
    """Every table a rank writes: the spool's (built-ins and collector-declared ones) and the ``dist_*`` records."""
    return {**bulk_tables(), **DIST_TABLES}


def shard_schema(table: str) -> pa.Schema:
    """The columns of a shard file: the table's, less the partition columns, plus ``restart``."""
    import pyarrow as pa

    schema = arrow_schema(shard_tables()[table])
    fields = [f for f in schema if f.name not in PATH_COLUMNS]
    if "restart" not in schema.names:
        fields.append(pa.field("restart", pa.int64()))
    return pa.schema(fields)


def table_glob(root: Path, table: str) -> str:
    return str(root / table / "*" / "*" / "*.parquet")


def partition_dir(root: Path, table: str, run_id: str, rank: int) -> Path:
    return root / table / f"run_id={run_id}" / f"rank={rank}"


def to_shard(table: str, data: pa.Table, attempt: int) -> pa.Table:
    """A table's rows in shard form (partition columns dropped, ``restart`` set where the table has none)."""
    import pyarrow as pa

    data = data.cast(arrow_schema(shard_tables()[table]))
    data = data.drop_columns([c for c in PATH_COLUMNS if c in data.column_names])
    if "restart" not in data.column_names:
        data = data.append_column("restart", pa.array([attempt] * data.num_rows, pa.int64()))
    return data.select(shard_schema(table).names)


class ShardSpool(Spool):
    """The spool of one rank: collectors write to it as to a capture's spool; parts land in the shard tree."""

    def __init__(self, root: Path, staging: Path, run_id: str, rank: int | None, attempt: int) -> None:
        super().__init__(staging)
        self.root, self.run_id, self.rank, self.attempt = root, run_id, rank, attempt
        self._counter = itertools.count()
        self._lock = threading.Lock()

    def _folder(self, table: str) -> Path:
        if self.rank is None:
            return self.directory / table
        return partition_dir(self.root, table, self.run_id, self.rank)

    def write_table(self, table: str, data: pa.Table, part: str | None = None) -> Path | None:
        if table not in shard_tables():
            raise ValueError(f"unknown table {table!r}")
        if data.num_rows == 0:
            return None
        shard = to_shard(table, data, self.attempt)
        with self._lock:
            name = f"a{self.attempt}-{part or f'{os.getpid()}-{next(self._counter):06d}'}"
            folder = self._folder(table)
            folder.mkdir(parents=True, exist_ok=True)
            return write_parquet(shard, folder / f"{name}.parquet")

    def write_records(self, cls: type[Any], records: list[Any]) -> Path | None:
        if not records:
            return None
        return self.write_table(cls.TABLE, records_to_arrow(cls, records))

    def set_rank(self, rank: int) -> None:
        """The rank is known now: later parts go to its partition, staged ones are moved there."""
        with self._lock:
            if self.rank == rank:
                return
            self.rank = rank
            if not self.directory.is_dir():
                return
            for table_dir in self.directory.iterdir():
                if not table_dir.is_dir():
                    continue
                target = partition_dir(self.root, table_dir.name, self.run_id, rank)
                target.mkdir(parents=True, exist_ok=True)
                for part in table_dir.glob("*.parquet"):
                    os.replace(part, target / part.name)
            shutil.rmtree(self.directory, ignore_errors=True)
