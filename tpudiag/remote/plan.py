"""Which local files of a node's run folder are final, and the object name each one gets.

- Rank shards (``shards/<table>/run_id=<id>/rank=<r>/<part>.parquet``) are final as soon as they exist: a part is
  written under a hidden temporary name and renamed into place (``tpudiag.spool.write_parquet``).
- Everything else in the run folder (raw traces, repro bundles, worker notes) may still be growing while the job
  runs, so it is final only at the end of the job or when an event names it (a finished trace window).
- ``*.xplane.pb`` files are uploaded twice: under ``raw/`` and in XProf's ``plugins/profile/session_<run>/`` layout
  as ``<host>_<rank>``; the rank comes from the rank record whose worker folder holds the file.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tpudiag.remote import layout

# Folders of a run that are tpudiag's own bookkeeping, never uploaded as raw files.
PRIVATE = {"shards", "shards-staging", "spool", "upload", "bin", "nodes"}


@dataclass(frozen=True)
class Item:
    local: Path
    object: tuple[str, ...]  # parts under the remote prefix


def _visible(path: Path) -> bool:
    return path.is_file() and not path.name.startswith(".") and not path.name.endswith(".tmp")


def shard_items(run_dir: Path, run_id: str, node: str) -> Iterator[Item]:
    root = run_dir / "shards"
    if not root.is_dir():
        return
    for part in sorted(root.glob("*/*/rank=*/*.parquet")):
        if not _visible(part):
            continue
        rank = layout.partition_value(part.parent.name, "rank")
        if rank is None or not rank.lstrip("-").isdigit():
            continue
        table = part.parent.parent.parent.name
        yield Item(part, layout.shard_object(table, run_id, node, int(rank), part.name))


def raw_items(run_dir: Path, run_id: str, node: str, only: Iterable[Path] | None = None) -> Iterator[Item]:
    """Raw files: every non-private file of the run folder, or only ``only`` (paths inside it)."""
    if only is not None:
        files = [Path(p) for p in only]
    else:
        files = [
            p
            for top in sorted(run_dir.iterdir()) if top.name not in PRIVATE
            for p in ([top] if top.is_file() else sorted(top.rglob("*")))
        ]  # fmt: skip
    ranks = worker_ranks(run_dir)
    for path in files:
        if not _visible(path):
            continue
        try:
            relative = path.resolve().relative_to(run_dir.resolve()).as_posix()
        except ValueError:
            continue
        if relative.split("/", 1)[0] in PRIVATE:
            continue
        yield Item(path, layout.raw_object(run_id, node, relative))
        if path.name.endswith(".xplane.pb"):
            found = _rank_of(path, run_dir, ranks)
            if found is not None:
                yield Item(path, layout.xplane_object(run_id, found[0], found[1]))


def worker_ranks(run_dir: Path) -> dict[str, tuple[str, int]]:
    """Worker folder name -> (host, rank) from the rank records in the node's shards."""
    found: dict[str, tuple[str, int]] = {}
    folder = run_dir / "shards" / "dist_ranks"
    if not folder.is_dir():
        return found
    import pyarrow.parquet as pq

    for part in folder.glob("*/rank=*/*.parquet"):
        if not _visible(part):
            continue
        rank = int(part.parent.name.split("=", 1)[1])
        try:
            rows = pq.read_table(part, columns=["artifacts_dir", "host"]).to_pylist()
        except Exception:  # a record we cannot read: that worker's XPlanes stay under raw/ only
            continue
        for row in rows:
            if row.get("artifacts_dir"):
                found[Path(row["artifacts_dir"]).name] = (str(row.get("host") or "host"), rank)
    return found


def _rank_of(path: Path, run_dir: Path, ranks: dict[str, tuple[str, int]]) -> tuple[str, int] | None:
    workers = (run_dir / "workers").resolve()
    try:
        tag = path.resolve().relative_to(workers).parts[0]
    except (ValueError, IndexError):
        return ranks.get(run_dir.name)  # a one-process run: its rank record names the run folder itself
    return ranks.get(tag)
