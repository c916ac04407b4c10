"""``tpudiag gather URL [--run ID]``: a run's shards from the bucket merged into a local store as one run.

Every node's manifest-listed shard objects are downloaded into the local run folder's shard tree
(``shards/<table>/run_id=<id>/rank=<r>/<node>--<part>.parquet``: the same layout a single-node job writes, the node
key in the file name keeps parts of different nodes apart) and merged by ``tpudiag.distributed.merge`` exactly
as a one-machine job is.  Objects already downloaded are skipped, and the merge replaces the run's rows, so gather
can be repeated while the job runs.  Raw traces, XPlanes and repro bundles stay in the bucket unless asked for:
``--raw`` downloads the run's ``raw/`` objects too, each node's under ``<run folder>/raw/<node>/`` in the layout of
its run folder (worker folders, trace windows, repro bundles), to open in XProf, Perfetto or ``tpudiag repro``.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpudiag.distributed import merge
from tpudiag.model import Run
from tpudiag.remote import catalog
from tpudiag.remote.location import Remote, redact
from tpudiag.store import Store

_WORSE = {"ok": 0, "interrupted": 1, "failed": 2}
GATHERED_NOTE = "gathered from"  # how a gathered run's notes begin their line on its nodes (``tpudiag repro``)


@dataclass
class GatherResult:
    run_id: str
    status: str
    nodes: int
    finished: list[str]
    unfinished: list[str]
    downloaded: int
    skipped: int
    raw_downloaded: int = 0
    raw_skipped: int = 0
    raw_dir: str | None = None


def local_part(run_dir: Path, node: str, obj: str) -> Path | None:
    """``shards/<table>/run_id=<id>/node=<n>/rank=<r>/<part>`` -> its place in the local shard tree."""
    parts = obj.split("/")
    if len(parts) != 6 or parts[0] != "shards" or not parts[4].startswith("rank="):
        return None
    return run_dir / "shards" / parts[1] / parts[2] / parts[4] / f"{node}--{parts[5]}"


def local_raw(run_dir: Path, node: str, obj: str) -> Path | None:
    """``raw/run_id=<id>/node=<n>/<path>`` -> ``<run folder>/raw/<n>/<path>`` (None for anything else, or a path
    that would leave that folder)."""
    parts = obj.split("/")
    if len(parts) < 4 or parts[0] != "raw" or not parts[2].startswith("node="):
        return None
    rest = parts[3:]
    if any(p in ("", ".", "..") for p in rest):
        return None
    return run_dir / "raw" / node / Path(*rest)


def _download(fs: Any, remote: Remote, obj: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.tmp"
    try:
        fs.get_file(remote.path(obj), str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def run_record(run_id: str, states: list[catalog.NodeState], run_dir: Path) -> Run:
    """The gathered run's record: the first finished node's record, status and exit code combined over nodes."""
    base: dict[str, Any] = {}
    for s in states:
        record = (s.complete or {}).get("run")
        if isinstance(record, dict):
            base = record
            break
    known = {f.name for f in dataclasses.fields(Run)}
    fields = {k: v for k, v in base.items() if k in known}
    fields.update(id=run_id, artifacts_dir=str(run_dir.resolve()), source="capture")
    fields.setdefault("name", run_id)
    fields.setdefault("started_at", min((s.last_written for s in states), default=time.time()))
    status, exit_code, notes = "ok", 0, []
    for s in states:
        if s.complete is None:
            notes.append(f"node {s.node}: no completion marker (crashed, or still running when gathered)")
            status = "interrupted" if _WORSE[status] < 1 else status
            continue
        st = str(s.complete.get("status") or "ok")
        if _WORSE.get(st, 0) > _WORSE[status]:
            status = st
        if not exit_code and s.complete.get("exit_code"):
            exit_code = int(s.complete["exit_code"])
        notes += [n for n in s.complete.get("notes") or [] if n not in notes and "other node" not in n]
    notes.append(f"{GATHERED_NOTE} {len(states)} node(s): {', '.join(s.node for s in states)}")
    fields.update(status=status, exit_code=exit_code if status != "interrupted" or exit_code else None)
    fields["notes"] = notes
    return Run(**fields)


def _fetch(fs: Any, remote: Remote, items: list[tuple[str, Path]]) -> tuple[int, int]:
    """Download each (object, local path) not here yet (objects are written once); (downloaded, skipped)."""
    downloaded = skipped = 0
    for obj, target in items:
        if target.is_file():
            skipped += 1
            continue
        try:
            _download(fs, remote, obj, target)
        except Exception as err:
            from tpudiag.errors import TpudiagError

            raise TpudiagError(redact(f"cannot download {obj}: {type(err).__name__}: {err}")) from None
        downloaded += 1
    return downloaded, skipped


def gather(store: Store, remote: Remote, run_id: str | None, raw: bool = False) -> GatherResult:
    fs = remote.filesystem()
    rid = catalog.resolve_run(remote, fs, run_id)
    states = catalog.nodes(remote, fs, rid)
    run_dir = store.run_dir(rid)
    shards = [
        (obj, target)
        for state in states
        for obj in state.shard_objects()
        if (target := local_part(run_dir, state.node, obj)) is not None
    ]
    downloaded, skipped = _fetch(fs, remote, shards)
    raw_downloaded = raw_skipped = 0
    if raw:
        raws = [
            (obj, target)
            for state in states
            for obj in state.objects
            if (target := local_raw(run_dir, state.node, obj)) is not None
        ]
        raw_downloaded, raw_skipped = _fetch(fs, remote, raws)
    run = run_record(rid, states, run_dir)
    merged = merge.store_merged(store, run, lambda w: merge.finish(store, run, run_dir, con=w))
    return GatherResult(
        rid,
        merged.status,
        len(states),
        [s.node for s in states if s.complete is not None],
        [s.node for s in states if s.complete is None],
        downloaded,
        skipped,
        raw_downloaded,
        raw_skipped,
        str(run_dir / "raw") if raw else None,
    )
