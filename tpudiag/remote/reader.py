"""``tpudiag report --remote URL RUN``: a run's distributed summary read where it lies, with no copy.

DuckDB reads the manifest-listed Parquet objects through the bucket's fsspec filesystem
(``DuckDBPyConnection.register_filesystem``; DuckDB's own httpfs extension is not needed, which matters where
extensions cannot be downloaded).  Only the run's own ``run_id=`` partitions are read (the object list comes from
its manifests: partition pruning by construction) and only the columns a query names (Parquet range reads).  The
``dist_*`` tables are built in an in-memory database by the same code a local merge uses
(``tpudiag.distributed.merge.load_rank_data``) and the section by the same code ``tpudiag report`` uses
(``report_section.section_from``), so both give the same answers.  Raw traces are never read here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpudiag.distributed import merge
from tpudiag.distributed.records import Fingerprint, RankInfo
from tpudiag.distributed.report_section import section_from
from tpudiag.errors import UsageError
from tpudiag.remote import catalog
from tpudiag.remote.gather import run_record
from tpudiag.remote.location import Remote
from tpudiag.store import distributed_queries as q

if TYPE_CHECKING:
    import duckdb

_HIVE = (
    "hive_partitioning = true, hive_types = {'run_id': VARCHAR, 'node': VARCHAR, 'rank': BIGINT}, union_by_name = true"
)


# What the distributed merge reads of each table (``distributed_queries``): every other table is small and read
# whole.  Each object is read once, with only these columns (Parquet column chunks: range reads).
_PROJECTIONS = {
    # the collectives, plus one row per (rank, restart) for the ranks that traced anything (``present_ranks``)
    "trace_events": (
        "SELECT rank, restart, name, category, shapes, dtypes, start_ns, dur_ns, event_id FROM {src} "
        f"WHERE {q.COLLECTIVE_ROWS} "
        "UNION ALL SELECT DISTINCT rank, restart, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM {src}"
    ),
    # checked ops with what ``rank_numerics_queries`` lists of them, plus one row per (rank, restart)
    "ops": "SELECT rank, restart, seq, checked, op, overload, module, phase, source_loc, step, kind, region, graph_id, "
    "fx_node FROM {src} WHERE checked UNION ALL BY NAME SELECT DISTINCT rank, restart FROM {src}",
    # every diff but skipped ones (no count or listing reads those), plus one row per (rank, restart)
    "op_diffs": "SELECT * FROM {src} WHERE verdict <> 'skip' OR role IS NOT NULL "
    "UNION ALL BY NAME SELECT DISTINCT rank, restart FROM {src}",
    # every step's period, for the per-rank step figures (``distributed_queries.STEP_FIGURES``)
    "pulse": "SELECT rank, restart, dur_ns, gap_ns FROM {src}",
}
# The shard tables the merge reads (others, e.g. trace windows and memory figures, stay in the bucket).
_MERGED = {RankInfo.TABLE, Fingerprint.TABLE, "steps", "compile_events", "trace_events", "ops", "op_diffs", "pulse"}


CHUNK = int(os.environ.get("TPUDIAG_REMOTE_CHUNK", "16"))  # objects per scan (see ``BucketShards.load``)


class BucketShards:
    """The shard objects of one run, as ``distributed_queries`` reads them (a ``ShardSource``).

    ``load(con)`` reads each table's objects once into a temporary table of ``con`` (only what the merge needs);
    the merge's queries then run against those, so no object is fetched twice."""

    def __init__(self, remote: Remote, states: list[catalog.NodeState]) -> None:
        self.by_table: dict[str, list[str]] = defaultdict(list)
        for state in states:
            for obj in state.shard_objects():  # file://: DuckDB's own file system reads the plain path
                name = remote.path(obj) if remote.protocol == "file" else remote.uri(obj)
                table = obj.split("/")[1]
                if table in _MERGED:
                    self.by_table[table].append(name)

    def files(self, table: str) -> list[str]:
        return sorted(self.by_table.get(table, []))

    @staticmethod
    def read(files: list[str]) -> str:
        """A subquery over these objects (their ``node=`` partition dropped: a file column of no table)."""
        names = ", ".join("'" + f.replace("'", "''") + "'" for f in files)
        return f"(SELECT * EXCLUDE (node) FROM read_parquet([{names}], {_HIVE}))"

    def _remote(self, table: str) -> str:
        return self.read(self.files(table))

    def load(self, con: duckdb.DuckDBPyConnection) -> None:
        # A scan through a Python filesystem holds some memory per object until it ends: objects go in chunks of
        # CHUNK, so the peak does not grow with the number of ranks.
        for table in self.by_table:
            files = self.files(table)
            for start in range(0, len(files), CHUNK):
                query = _PROJECTIONS.get(table, "SELECT * FROM {src}").format(
                    src=self.read(files[start : start + CHUNK])
                )
                if start == 0:
                    con.execute(f'CREATE TEMP TABLE "remote_{table}" AS {query}')
                else:
                    con.execute(f'INSERT INTO "remote_{table}" BY NAME {query}')

    def source(self, table: str) -> str:
        return f'"remote_{table}"'

    def drop(self, con: duckdb.DuckDBPyConnection) -> None:
        """Free the copies once the ``dist_*`` tables hold them (they would double what grows with ranks)."""
        for table in self.by_table:
            con.execute(f'DROP TABLE IF EXISTS "remote_{table}"')


def connect_remote(con: duckdb.DuckDBPyConnection, remote: Remote, fs: Any, source: BucketShards, run_id: str) -> None:
    """Let ``con`` read the bucket's objects through ``fs`` (no DuckDB extension), quietly."""
    import duckdb

    with contextlib.suppress(duckdb.Error):  # Jupyter refuses the setting without ipywidgets (no bar there)
        con.execute("SET enable_progress_bar = false")  # DuckDB draws it on stdout, the report's (--json)
    with contextlib.suppress(duckdb.Error):  # each object is read once: a cache of their bytes only costs memory
        con.execute("SET enable_external_file_cache = false")
    if remote.protocol == "file":
        return
    con.register_filesystem(fs)
    # One listing per table of this run fills the client's directory cache: DuckDB asks each object's size and
    # time several times, which would otherwise be a HEAD request each.
    for table in source.by_table:
        with contextlib.suppress(Exception):
            fs.find(remote.path("shards", table, f"run_id={run_id}"))


# DuckDB's memory for the read, tried in turn: its tables spill to a temporary folder past the limit, so the
# report's memory hardly grows with the number of ranks (measured from a file:// bucket, 1,000 events a rank: peak
# 134 / 205 / 282 MB at 256 / 1,024 / 2,048 ranks without a limit, 114 / 129 / 137 MB with 32 MB).  A read that
# cannot fit (DuckDB's out-of-memory error: under 16 MB, 1,024 ranks' collectives did not) is read again under the
# next limit; the last is DuckDB's own default.
MEMORY_LIMITS: tuple[str | None, ...] = ("32MB", "256MB", None)  # the first one: TPUDIAG_REMOTE_MEMORY if set


def remote_report(remote: Remote, run_id: str | None) -> dict[str, Any]:
    import duckdb

    fs = remote.filesystem()
    rid = catalog.resolve_run(remote, fs, run_id)
    states = catalog.nodes(remote, fs, rid)
    section: dict[str, Any] | None = None
    first = os.environ.get("TPUDIAG_REMOTE_MEMORY") or MEMORY_LIMITS[0]
    with tempfile.TemporaryDirectory(prefix="tpudiag-remote-") as spill:
        for limit in (first, *MEMORY_LIMITS[1:]):
            try:
                section = _section(remote, fs, rid, states, limit, spill)
                break
            except duckdb.OutOfMemoryException:
                if limit is None:
                    raise
    run = dataclasses.asdict(run_record(rid, states, Path(".")))
    run.pop("artifacts_dir", None)
    nodes = [
        {
            "node": s.node,
            "host": s.host,
            "finished": s.complete is not None,
            "status": (s.complete or {}).get("status"),
            "objects": len(s.objects),
        }
        for s in states
    ]
    return {"run": run, "remote": remote.url, "nodes": nodes, "distributed": section}


def _section(
    remote: Remote, fs: Any, rid: str, states: list[catalog.NodeState], limit: str | None, spill: str
) -> dict[str, Any] | None:
    """The distributed section of run ``rid``, its rows in an in-memory database that spills to ``spill``."""
    import duckdb

    con = duckdb.connect(":memory:")
    try:
        con.execute("SET temp_directory = ?", [spill])
        if limit:
            try:
                con.execute("SET memory_limit = ?", [limit])
            except duckdb.Error:
                raise UsageError(f"TPUDIAG_REMOTE_MEMORY={limit!r}: expected a memory size such as 32MB") from None
        source = BucketShards(remote, states)
        connect_remote(con, remote, fs, source, rid)
        source.load(con)
        merge.load_rank_data(con, source, rid)
        source.drop(con)
        return section_from(con, rid)
    finally:
        con.close()


def render(data: dict[str, Any]) -> str:
    from tpudiag.distributed.report_section import render_section

    run = data["run"]
    lines = [f"run {run['id']} ({run['status']}, exit {run['exit_code']}) read from {data['remote']}"]
    for n in data["nodes"]:
        state = f"finished ({n['status']})" if n["finished"] else "no completion marker (crashed or running)"
        lines.append(f"  node {n['node']}: {state}, {n['objects']} objects")
    if data["distributed"]:
        lines += render_section(data["distributed"])
    else:
        lines.append("no rank records in the bucket for this run yet")
    return "\n".join(lines) + "\n"
