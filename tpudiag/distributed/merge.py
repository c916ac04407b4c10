"""A job's rank shards merged into its run, in the caller's store transaction.

- every attempt of every rank goes into the ``dist_*`` tables (rank records, fingerprints, collectives, steps,
  compile events): the cross-rank analyses read these small per-rank tables, never the events;
- the last attempt's trace events, steps and compile events of every rank, and the ops and op diffs of its lowest
  rank, go into the run's own tables, so ``report``, the dashboard and the exports work as for any run;
- every rank's divergent ops and per-op numerics counts go into ``dist_op_diffs`` / ``dist_numerics``
  (``tpudiag.store.rank_numerics_queries``), so a fault on any rank reaches the report, ``compare`` and ``check``;
- a rank that wrote data but no rank record (killed before it could) is ``lost``, and so is a rank of the world
  that wrote nothing at all;
- the run is ``failed`` when a rank of the last attempt failed, and its notes say which rank failed first.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpudiag.distributed import analysis
from tpudiag.distributed.records import RankInfo
from tpudiag.errors import TpudiagError
from tpudiag.model import Run, records_to_arrow
from tpudiag.store import Store, rank_numerics_queries
from tpudiag.store import distributed_queries as q

if TYPE_CHECKING:
    import duckdb

_ITEM_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4, "bool": 1}


def has_shards(run_dir: Path) -> bool:
    root = run_dir / "shards"
    return root.is_dir() and any(root.glob("*/*/*/*.parquet"))


def collective_bytes(shapes_json: str | None, dtypes_json: str | None) -> int | None:
    """Bytes a collective moves, from its input dims and types as the trace records them (JSON lists)."""
    try:
        shapes = json.loads(shapes_json) if shapes_json else []
        dtypes = json.loads(dtypes_json) if dtypes_json else []
    except ValueError:
        return None
    if not isinstance(shapes, list) or not isinstance(dtypes, list):
        return None
    total = 0
    for dims, dtype in zip(shapes, dtypes, strict=False):
        if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
            continue
        n = 1
        for d in dims:
            n *= d
        total += n * _ITEM_BYTES.get(str(dtype), 4)
    return total or None


def _lost_ranks(run_id: str, infos: list[dict[str, Any]], present: set[tuple[int, int]]) -> list[RankInfo]:
    known = {(int(r["rank"]), int(r["restart"])) for r in infos}
    world = max((int(r["world_size"] or 0) for r in infos), default=0)
    attempts = {a for _, a in known | present}
    expected = set(present) | {(r, a) for a in attempts for r in range(world)}
    return [
        RankInfo(run_id=run_id, rank=r, restart=a, world_size=world or None, status="lost")
        for r, a in sorted(expected - known)
    ]


def load_rank_data(con: duckdb.DuckDBPyConnection, root: q.Root, run_id: str) -> list[dict[str, Any]]:
    """The ``dist_*`` tables of ``run_id`` from the shards under ``root`` (a local folder or a bucket's objects),
    lost ranks included; the rank records."""
    q.ensure_tables(con)
    q.clear_run(con, run_id)
    q.load_rank_tables(con, root, run_id)
    pairs = q.load_collectives(con, root, run_id)
    q.set_bytes(con, run_id, {p: collective_bytes(*p) for p in pairs})
    infos = q.ranks(con, run_id)
    lost = _lost_ranks(run_id, infos, q.present_ranks(con, root))
    if lost:  # Arrow (and DuckDB's pandas scan) only when there is something to insert
        q.insert_arrow(con, RankInfo.TABLE, records_to_arrow(RankInfo, lost))
    q.set_numerics_counts(con, run_id, q.numerics_counts(con, root))
    rank_numerics_queries.load(con, root, run_id)  # every rank's divergent ops, not only the main tables' rank
    return q.ranks(con, run_id)


def finish(store: Store, run: Run, run_dir: Path, con: duckdb.DuckDBPyConnection, main_tables: bool = True) -> Run:
    """Merge the shards under ``run_dir/shards`` into ``run``; returns the run with status and notes updated.

    ``main_tables=False`` (``torch.multiprocessing.spawn`` jobs, whose run's own tables hold the parent process)
    loads only the ``dist_*`` tables.
    """
    root = run_dir / "shards"
    if not has_shards(run_dir):
        return dataclasses.replace(run, notes=[*run.notes, "no rank wrote any data (were the workers captured?)"])
    infos = load_rank_data(con, root, run.id)
    last = max(int(r["restart"]) for r in infos)
    lowest = min(int(r["rank"]) for r in infos if int(r["restart"]) == last)
    if main_tables:
        q.load_main_tables(con, root, run.id, last, lowest)
        store.summarize_run(run.id, con)
    return outcome(run, infos)


def outcome(run: Run, infos: list[dict[str, Any]]) -> Run:
    """The run's status and notes from its rank records (first failure per attempt, restarts)."""
    last = max(int(r["restart"]) for r in infos)
    notes = list(run.notes)
    status = run.status
    for attempt in sorted({int(r["restart"]) for r in infos}):
        failure = analysis.first_failure([r for r in infos if int(r["restart"]) == attempt])
        if failure is None:
            continue
        notes.append(
            f"attempt {attempt}: rank {failure['rank']} failed first"
            + (f" (exit {failure['exit_code']})" if failure.get("exit_code") is not None else "")
            + (f": {failure['error']}" if failure.get("error") else "")
        )
        if attempt == last and status == "ok":
            status = "failed"
    attempts = len({int(r["restart"]) for r in infos})
    if attempts > 1:
        notes.append(f"the job ran {attempts} attempts (torchelastic restarts); each is kept")
    return dataclasses.replace(run, status=status, notes=notes)


def store_merged(store: Store, run: Run, finish: Callable[[duckdb.DuckDBPyConnection], Run]) -> Run:
    """Merge in one transaction and store the run; if the merge fails, the run is stored anyway, saying why.

    The ranks' shards stay on disk either way (``<run folder>/shards``), readable with DuckDB or Spark.
    """
    try:
        with store.writer() as w:
            merged = finish(w)
            store.put_run(merged, con=w)
        return merged
    except TpudiagError:
        raise
    except Exception as err:  # a shard we cannot read must not lose the run
        failed = dataclasses.replace(
            run, notes=[*run.notes, f"the ranks' shards could not be merged ({type(err).__name__}: {err})"]
        )
        store.put_run(failed)
        return failed
