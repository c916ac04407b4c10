"""``tpudiag import``: a run (source "import") from existing profiles.

Each file is detected from its content, read, analysed and spooled as Parquet parts in the new run's folder; the
run row and every part then go into the store in one transaction, so a failure at any point leaves the store as it
was (the run's folder is removed).  A bad file among several is reported and skipped; when no file imports, the
command fails with the first file's error.
"""

from __future__ import annotations

import functools
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from tpudiag.clock import SystemClock
from tpudiag.errors import ImportFormatError, TpudiagError
from tpudiag.model import CompileEvent, Run
from tpudiag.progress import StatusLine
from tpudiag.run_setup import new_run_id
from tpudiag.spool import Spool
from tpudiag.store import Store, bulk_insert
from tpudiag.traces import detect
from tpudiag.version import __version__

_RANK_SUFFIX = re.compile(r"_(\d+)$")
Status = Callable[[str], None]


@dataclass
class ImportResult:
    run_id: str
    imported: list[Path] = field(default_factory=list)
    failed: list[tuple[Path, str]] = field(default_factory=list)
    events: int = 0
    compile_events: int = 0
    device_kind: str = "cpu"
    device_name: str | None = None
    # The latest file's tables, kept in memory and written straight from Arrow (one file at a time: older ones
    # go to the spool, so memory stays one file's worth).
    pending: list[tuple[str, pa.Table]] = field(default_factory=list)


def import_paths(
    store: Store, paths: list[Path], name: str | None = None, status: StatusLine | None = None
) -> ImportResult:
    files = detect.expand(paths)
    status = status or StatusLine()
    run_id = new_run_id(SystemClock())
    run_dir = store.run_dir(run_id).resolve()
    spool = Spool(run_dir / "spool")
    result = ImportResult(run_id=run_id)
    started = time.time()
    try:
        for index, path in enumerate(files):
            label = f"[{index + 1}/{len(files)}] {path.name}"
            status(f"importing {label}", force=True)
            try:
                _import_one(path, index, run_id, spool, result, functools.partial(_progress, status, label))
            except TpudiagError as err:
                if len(files) == 1:
                    raise
                result.failed.append((path, str(err)))
                continue
            result.imported.append(path)
        status.done()
        if not result.imported:
            first = result.failed[0][1] if result.failed else "nothing to import"
            raise ImportFormatError(f"no file could be imported; first error: {first}")
        run = Run(
            id=run_id,
            name=name or _default_name(paths),
            status="ok",
            started_at=started,
            exit_code=0,
            source="import",
            argv=[str(p) for p in paths],
            cwd=str(Path.cwd()),
            duration_s=round(time.time() - started, 6),
            host=socket.gethostname(),
            tpudiag_version=__version__,
            device_kind=result.device_kind,
            device_name=result.device_name,
            collectors=["import"],
            notes=[f"not imported: {msg}" for _, msg in result.failed],
            artifacts_dir=str(run_dir),
        )
        status(f"writing {result.events:,} events to {store.path}", force=True)
        run_dir.mkdir(parents=True, exist_ok=True)  # the run's artifacts folder, even when nothing was spooled
        with store.writer() as w:
            store.put_run(run, con=w)
            store.ingest_spool(run_id, spool.directory, con=w)
            for table, data in result.pending:
                bulk_insert.insert_arrow(w, table, data)
            store.summarize_run(run_id, w)
        status.done()
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    shutil.rmtree(spool.directory, ignore_errors=True)
    return result


def _default_name(paths: list[Path]) -> str:
    first = paths[0]
    stem = first.name
    for suffix in (".gz", ".json", ".pb", ".xplane", ".xspace", ".log"):
        stem = stem.removesuffix(suffix)
    return stem or str(first)


def _import_one(
    path: Path, index: int, run_id: str, spool: Spool, result: ImportResult, progress: Callable[[int], None]
) -> None:
    kind = detect.detect(path)
    if kind == detect.KINETO:
        from tpudiag.traces import kineto, kineto_tables

        trace = kineto.load(path, progress=progress, parallel=True)
        if len(trace) == 0:
            raise ImportFormatError(f"{path}: the trace holds no complete events")
        rank = trace.rank if trace.rank is not None else index
        tables = kineto_tables.to_tables(trace, run_id, rank=rank, first_event_id=result.events)
        _write(spool, result, tables.events, kineto_tables.steps_table(tables.steps, run_id, rank=rank))
        result.events += tables.events.num_rows
        props = trace.metadata.get("deviceProperties")
        if pc.any(tables.events.column("on_device")).as_py():
            result.device_kind = "cuda"
            if isinstance(props, list) and props and isinstance(props[0], dict):
                result.device_name = str(props[0].get("name") or "") or result.device_name
    elif kind == detect.XPLANE:
        from tpudiag.traces import kineto_tables, xplane

        m = _RANK_SUFFIX.search(xplane.host_of(path))
        rank = int(m.group(1)) if m else index
        xt = xplane.load(path, run_id, rank=rank, first_event_id=result.events, parallel=True)
        if xt.events.num_rows == 0:
            raise ImportFormatError(f"{path}: the XPlane holds no events")
        _write(spool, result, xt.events, kineto_tables.steps_table(xt.steps, run_id, rank=rank))
        kept = spool.directory.parent / "trace" / f"{index:03d}-{path.name}"
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, kept)  # beside the run: exporters hand the original to XProf
        result.events += xt.events.num_rows
        progress(result.events)
        devices = set(xt.devices)
        if any("TPU" in d for d in devices):
            result.device_kind, result.device_name = "tpu", sorted(devices)[0]
        elif devices and result.device_kind == "cpu":
            result.device_kind, result.device_name = "cuda", sorted(devices)[0]
    else:
        if not detect.torch_trace_module_available():
            raise ImportFormatError(f"{path}: TORCH_TRACE import not available yet")
        from tpudiag.traces import torch_trace

        events = torch_trace.read_torch_trace(path, run_id)
        if not events:
            raise ImportFormatError(f"{path}: the TORCH_TRACE log holds no compile events")
        events = [_renumber(e, result.compile_events + k) for k, e in enumerate(events)]
        spool.write_records(CompileEvent, events)
        result.compile_events += len(events)


def _renumber(event: CompileEvent, seq: int) -> CompileEvent:
    import dataclasses

    return dataclasses.replace(event, seq=seq) if event.seq != seq else event


def _write(spool: Spool, result: ImportResult, events: pa.Table, steps: pa.Table) -> None:
    for table, data in result.pending:
        spool.write_table(table, data)
    result.pending = [("trace_events", events), ("steps", steps)]


def _progress(status: Callable[..., None], label: str, events: int) -> None:
    status(f"{label}: {events:,} events")
