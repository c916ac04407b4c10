"""``tpudiag dashboard --remote URL``: a run's summaries read from the bucket into a small local view store.

The dashboard's pages read a store; this module fills a throwaway one (a temporary DuckDB file the dashboard
command deletes on exit) with what the pages show, read by DuckDB over the bucket's Parquet through fsspec, the
same way ``report --remote`` reads it (``reader.BucketShards``: manifest-listed objects of the run only, each
read once, only the needed columns):

- the run record (status, exit code, notes combined over nodes as ``gather`` does) and the ``dist_*`` tables
  (Ranks page, the report's distributed section) built by ``merge.load_rank_data``;
- steps and compile events of every rank of the last attempt, ops and op diffs of its lowest rank only (objects
  picked by their ``rank=`` partition), as a local merge loads them;
- ``op_summary`` (Slow ops) aggregated by DuckDB from the trace-event objects while they are read: the events
  themselves are never stored, so a step filter, the step timeline and an op's calls need ``tpudiag gather``.

Raw traces stay in the bucket.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from tpudiag.distributed import merge
from tpudiag.distributed.records import RankInfo
from tpudiag.model import Run
from tpudiag.remote import catalog
from tpudiag.remote.gather import run_record
from tpudiag.remote.location import Remote
from tpudiag.remote.reader import BucketShards, connect_remote
from tpudiag.store import Store
from tpudiag.store import distributed_queries as q

# The note every remote view's run carries: what the pages cannot show without the events.
VIEW_NOTE = "read from {url} (summaries only; tpudiag gather for the events: step filter, timeline, op calls)"


def _pruned(source: BucketShards, table: str, rank: int) -> str | None:
    """``read_parquet`` over one rank's objects of ``table`` (partition pruning by object name), or None."""
    files = [f for f in source.files(table) if f"/rank={rank}/" in f]
    if not files:
        return None
    return source.read(files)


def load_view(store: Store, remote: Remote, run_id: str | None) -> Run:
    """Fill ``store`` with run ``run_id`` (default: the newest) of ``remote``; returns the run as stored."""
    fs = remote.filesystem()
    rid = catalog.resolve_run(remote, fs, run_id)
    states = catalog.nodes(remote, fs, rid)
    run = run_record(rid, states, store.run_dir(rid))
    run = dataclasses.replace(run, notes=[*run.notes, VIEW_NOTE.format(url=remote.url)])
    source = BucketShards(remote, states)
    with store.writer() as con:
        connect_remote(con, remote, fs, source, rid)
        source.load(con)
        if source.files(RankInfo.TABLE):
            infos = merge.load_rank_data(con, source, rid)
            run = _main_tables(con, source, run, infos)
        else:
            run = dataclasses.replace(run, notes=[*run.notes, "no rank records in the bucket for this run yet"])
        source.drop(con)
        store.put_run(run, con=con)
    return run


def _main_tables(con: Any, source: BucketShards, run: Run, infos: list[dict[str, Any]]) -> Run:
    last = max(int(r["restart"]) for r in infos)
    lowest = min(int(r["rank"]) for r in infos if int(r["restart"]) == last)
    for table in ("steps", "compile_events"):  # every rank, as the local merge (ids offset by rank there too)
        if source.files(table):
            replace = f", seq + ((rank + 1) << {q.ID_SHIFT}) AS seq" if table == "compile_events" else ""
            con.execute(
                f"INSERT INTO {table} BY NAME SELECT * EXCLUDE (restart) REPLACE (? AS run_id{replace}) "
                f"FROM {source.source(table)} WHERE restart = ?",
                [run.id, last],
            )
    for table in ("ops", "op_diffs"):  # one rank's numerics, as the local merge
        src = _pruned(source, table, lowest)
        if src is not None:
            con.execute(
                f"INSERT INTO {table} BY NAME SELECT * EXCLUDE (restart, rank) REPLACE (? AS run_id) FROM {src} "
                "WHERE restart = ?",
                [run.id, last],
            )
    if source.files("trace_events"):
        con.execute(
            "INSERT INTO op_summary SELECT ?, name, module, phase, category, on_device, count(*), sum(self_ns), "
            f"sum(dur_ns), max(self_ns) FROM {source.read(source.files('trace_events'))} WHERE restart = ? "
            "GROUP BY name, module, phase, category, on_device",
            [run.id, last],
        )
    return merge.outcome(run, infos)


def view_store(folder: Path, remote: Remote, run_id: str | None) -> tuple[Store, Run]:
    """A new view store under ``folder`` holding the run."""
    store = Store(folder / "remote-view.duckdb", lock_timeout_s=30.0)
    return store, load_view(store, remote, run_id)
