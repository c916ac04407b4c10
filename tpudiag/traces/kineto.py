"""Kineto / Chrome trace-event JSON (torch.profiler's ``export_chrome_trace``) into trace_events rows.

Timestamps: ``ts``/``dur`` are microseconds; Kineto adds ``baseTimeNanoseconds`` so that
``epoch_ns = baseTimeNanoseconds + ts * 1000``.  Only complete events (``ph == "X"``) become rows; metadata
events give process and thread names.

Reading streams: the (possibly gzipped) file is decompressed chunk by chunk, split into batches of whole events
(``jsonsplit.EventSplitter``) and decoded by msgspec into typed structs, with each event's ``args`` kept as raw JSON
and only the few fields tpudiag needs decoded.  Memory is the columnar result, never the JSON document.

GPU kernels are linked to the CPU op that launched them: a kernel shares its ``correlation`` id with the
``cuda_runtime``/``cuda_driver`` launch call (``cudaLaunchKernel``, ``cuLaunchKernel``, ``hipLaunchKernel``...), and
the launching op is the innermost ``cpu_op`` around that call.  The kernel row then carries that op's name
(``framework_op``), event id (``launch_id``), module, phase and step.
"""

from __future__ import annotations

import dataclasses
import re
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from tpudiag.analysis.steps import StepSpan, assign_steps, detect_steps
from tpudiag.analysis.tree import attribute_modules, depth_levels, nest_arrays, thread_codes
from tpudiag.errors import ImportFormatError
from tpudiag.model import Step, TraceEvent, arrow_schema
from tpudiag.traces.jsonsplit import EventSplitter, StreamFormatError

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_OP_CATEGORY = "cpu_op"
READ_CHUNK = 1 << 20  # compressed bytes read at a time
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)

Progress = Callable[[int], None]  # called with the number of events read so far


class _Event(msgspec.Struct):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = ""
    tid: int | str = ""
    ts: float | None = None
    dur: float | None = None
    args: msgspec.Raw = msgspec.Raw()


class _Args(msgspec.Struct):
    external_id: int | None = msgspec.field(default=None, name="External id")
    correlation: int | None = None
    seq: int | None = msgspec.field(default=None, name="Sequence number")
    dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input Dims")
    types: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input type")


_EVENTS = msgspec.json.Decoder(list[_Event])
_ARGS = msgspec.json.Decoder(_Args)
_ANY = msgspec.json.Decoder()
_RAW_COLUMNS = pa.schema(
    [
        ("process", pa.string()),
        ("thread", pa.string()),
        ("name", pa.string()),
        ("category", pa.string()),
        ("start_ns", pa.int64()),
        ("dur_ns", pa.int64()),
        ("args", pa.string()),
        ("external_id", pa.int64()),
        ("correlation", pa.int64()),
        ("seq_nr", pa.int64()),
        ("shapes", pa.string()),
        ("dtypes", pa.string()),
    ]
)


@dataclass
class KinetoTrace:
    """The complete events of one Chrome trace file, as Arrow columns (``start_ns`` already in epoch ns)."""

    base_ns: int = 0
    columns: pa.Table = field(default_factory=_RAW_COLUMNS.empty_table)
    process_names: dict[str, str] = field(default_factory=dict)
    thread_names: dict[tuple[str, str], str] = field(default_factory=dict)
    rank: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.columns.num_rows)


# -- reading -----------------------------------------------------------------------------------------------------
def _byte_chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of a plain or gzip file, a chunk at a time (multi-member gzip included)."""
    with path.open("rb") as f:
        first = f.read(2)
        f.seek(0)
        if first != b"\x1f\x8b":
            while chunk := f.read(READ_CHUNK * 16):
                yield chunk
            return
        d = zlib.decompressobj(wbits=31)
        while comp := f.read(READ_CHUNK):
            while comp:
                try:
                    out = d.decompress(comp)
                except zlib.error as err:
                    raise ImportFormatError(f"{path}: corrupt gzip data ({err})") from None
                if out:
                    yield out
                comp = d.unused_data if d.eof else b""
                if d.eof and comp:
                    d = zlib.decompressobj(wbits=31)
        if not d.eof:
            raise ImportFormatError(f"{path}: truncated gzip file (the compressed stream ends early)")


def load(path: Path, progress: Progress | None = None) -> KinetoTrace:
    """Read one Chrome/Kineto trace file (plain or gzip) with bounded memory."""
    splitter = EventSplitter()
    builder = _Builder()
    try:
        for chunk in _byte_chunks(path):
            batch = splitter.feed(chunk)
            if batch is not None:
                builder.add(_EVENTS.decode(batch))
                if progress is not None:
                    progress(builder.rows)
        rest = splitter.finish()
        meta = _ANY.decode(rest) if rest is not None else {}
    except StreamFormatError as err:
        raise ImportFormatError(f"{path}: {err}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ImportFormatError(f"{path}: not a valid Chrome/Kineto trace ({err})") from None
    trace = builder.finish(meta if isinstance(meta, dict) else {})
    if trace.rank is None and (m := _RANK_IN_NAME.search(path.name)):
        trace.rank = int(m.group(1))
    return trace


def parse(doc: Any, origin: str = "<trace>") -> KinetoTrace:
    """A trace already decoded as plain Python (a dict with ``traceEvents``, or a bare list of events)."""
    if isinstance(doc, list):
        events, meta = doc, {}
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events, meta = doc["traceEvents"], {k: v for k, v in doc.items() if k != "traceEvents"}
    else:
        raise ImportFormatError(f"{origin}: no traceEvents list: not a Chrome/Kineto trace")
    builder = _Builder()
    try:
        builder.add(_EVENTS.decode(msgspec.json.encode([e for e in events if isinstance(e, dict)])))
    except msgspec.ValidationError as err:
        raise ImportFormatError(f"{origin}: not a valid Chrome/Kineto trace ({err})") from None
    return builder.finish(meta)


class _Builder:
    """Accumulates decoded event batches as Arrow record batches (relative microsecond times until the end)."""

    def __init__(self) -> None:
        self.batches: list[pa.RecordBatch] = []
        self.rows = 0
        self.process_names: dict[str, str] = {}
        self.thread_names: dict[tuple[str, str], str] = {}

    def add(self, events: list[_Event]) -> None:
        xs = [e for e in events if e.ph == "X" and e.ts is not None]
        for e in events:
            if e.ph == "M" and e.args:
                self._metadata_event(e)
        if not xs:
            return
        ts = np.fromiter((e.ts for e in xs), dtype=np.float64, count=len(xs))
        dur = np.fromiter((e.dur or 0.0 for e in xs), dtype=np.float64, count=len(xs))
        whole = np.floor(ts)
        start = whole.astype(np.int64) * 1000 + np.rint((ts - whole) * 1000).astype(np.int64)
        raws = [e.args for e in xs]
        parsed = [_decode_args(r) for r in raws]
        none: list[Any] = [None] * len(xs)
        arrays = [
            pa.array([str(e.pid) for e in xs], pa.string()),
            pa.array([str(e.tid) for e in xs], pa.string()),
            pa.array([e.name for e in xs], pa.string()),
            pa.array([e.cat for e in xs], pa.string()),
            pa.array(start),
            pa.array(np.maximum(np.rint(dur * 1000), 0).astype(np.int64)),
            pa.array([bytes(r).decode() if r else None for r in raws], pa.string()),
            pa.array([a.external_id if a else None for a in parsed] if any(parsed) else none, pa.int64()),
            pa.array([a.correlation if a else None for a in parsed] if any(parsed) else none, pa.int64()),
            pa.array([a.seq if a else None for a in parsed] if any(parsed) else none, pa.int64()),
            pa.array(
                [_raw_text(a.dims) if a else None for a in parsed] if any(parsed) else none, pa.string()
            ),
            pa.array(
                [_raw_text(a.types) if a else None for a in parsed] if any(parsed) else none, pa.string()
            ),
        ]
        self.batches.append(pa.RecordBatch.from_arrays(arrays, schema=_RAW_COLUMNS))
        self.rows += len(xs)

    def _metadata_event(self, e: _Event) -> None:
        if e.name not in ("process_name", "thread_name"):
            return
        try:
            a = _ANY.decode(e.args)  # type: ignore[arg-type]
        except msgspec.DecodeError:
            return
        if not isinstance(a, dict):
            return
        if e.name == "process_name":
            self.process_names[str(e.pid)] = str(a.get("name", ""))
        else:
            self.thread_names[(str(e.pid), str(e.tid))] = str(a.get("name", ""))

    def finish(self, meta: dict[str, Any]) -> KinetoTrace:
        meta = {k: v for k, v in meta.items() if k != "traceEvents"}
        base = meta.get("baseTimeNanoseconds")
        base_ns = int(base) if isinstance(base, int | float) and not isinstance(base, bool) else 0
        table = pa.Table.from_batches(self.batches, schema=_RAW_COLUMNS)
        if base_ns:
            col = table.column("start_ns")
            table = table.set_column(1 + 3, "start_ns", pa.compute.add(col, base_ns))
        dist = meta.get("distributedInfo")
        rank = dist.get("rank") if isinstance(dist, dict) else None
        return KinetoTrace(
            base_ns=base_ns,
            columns=table,
            process_names=self.process_names,
            thread_names=self.thread_names,
            rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
            metadata=meta,
        )


def _decode_args(raw: msgspec.Raw) -> _Args | None:
    if not raw:
        return None
    try:
        return _ARGS.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        try:
            a = _ANY.decode(raw)
        except msgspec.DecodeError:
            return None
        if not isinstance(a, dict):
            return None
        return _Args(
            external_id=_int_or_none(a.get("External id")),
            correlation=_int_or_none(a.get("correlation")),
            seq=_int_or_none(a.get("Sequence number")),
        )


def _raw_text(raw: msgspec.Raw) -> str | None:
    if not raw:
        return None
    return msgspec.json.encode(_ANY.decode(raw)).decode()


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


# -- analysis ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceTables:
    events: pa.Table
    steps: list[StepSpan]


def to_tables(
    trace: KinetoTrace,
    run_id: str,
    rank: int = 0,
    first_event_id: int = 0,
    first_step: int = 0,
    module_sources: dict[str, str] | None = None,
    root_inputs: Sequence[str | None] = (),
    source: str = "kineto",
    whole_fallback: bool = True,
) -> TraceTables:
    """Analyse one trace (nesting, self time, modules, steps, kernel launches) and build its trace_events table."""
    cols = trace.columns
    n = len(trace)
    process: list[str] = cols.column("process").to_pylist()
    thread: list[str] = cols.column("thread").to_pylist()
    names: list[str] = cols.column("name").to_pylist()
    category = np.asarray(cols.column("category").to_pylist(), dtype=object)
    start = cols.column("start_ns").to_numpy()
    dur = cols.column("dur_ns").to_numpy()
    seq: list[int | None] = cols.column("seq_nr").to_pylist()
    codes = thread_codes(list(zip(process, thread, strict=True)))
    parent, depth, self_ns = nest_arrays(codes, start, dur)
    attr = attribute_modules(names, process, start, seq, parent, module_sources)
    steps = detect_steps(names, start, dur, parent, root_inputs, whole_fallback=whole_fallback)
    if first_step and not any(s.kind == "profiler_step" for s in steps):
        steps = [dataclasses.replace(s, step=s.step + first_step) for s in steps]
    step_of = np.asarray(assign_steps(start, steps), dtype=object)
    module = np.asarray(attr.module, dtype=object)
    phase = np.asarray(attr.phase, dtype=object)
    on_device = np.isin(category, list(DEVICE_CATEGORIES))

    launcher = _launching_ops(category, cols.column("correlation"), parent, on_device)
    linked = launcher >= 0
    framework_op = np.full(n, None, dtype=object)
    names_arr = np.asarray(names, dtype=object)
    framework_op[linked] = names_arr[launcher[linked]]
    for arr in (module, phase, step_of):
        arr[linked] = arr[launcher[linked]]
    launch_id = np.where(linked, launcher + first_event_id, -1)

    proc_label = [trace.process_names.get(p, p) for p in process]
    thread_label = [trace.thread_names.get(k, k[1]) for k in zip(process, thread, strict=True)]
    columns: dict[str, Any] = {
        "run_id": pa.repeat(run_id, n) if n else [],
        "event_id": np.arange(first_event_id, first_event_id + n, dtype=np.int64),
        "source": pa.repeat(source, n) if n else [],
        "process": proc_label,
        "thread": thread_label,
        "name": cols.column("name"),
        "category": cols.column("category"),
        "start_ns": start,
        "dur_ns": dur,
        "self_ns": self_ns,
        "depth": depth,
        "parent_id": pa.array(parent + first_event_id, mask=parent < 0),
        "rank": np.full(n, rank, dtype=np.int64),
        "step": pa.array(step_of.tolist(), pa.int64()),
        "module": pa.array(module.tolist(), pa.string()),
        "phase": pa.array(phase.tolist(), pa.string()),
        "source_loc": attr.source_loc,
        "shapes": cols.column("shapes"),
        "dtypes": cols.column("dtypes"),
        "seq_nr": cols.column("seq_nr"),
        "external_id": cols.column("external_id"),
        "correlation": cols.column("correlation"),
        "on_device": on_device,
        "flops": pa.nulls(n, pa.float64()),
        "bytes_accessed": pa.nulls(n, pa.float64()),
        "framework_op": pa.array(framework_op.tolist(), pa.string()),
        "hlo_category": pa.nulls(n, pa.string()),
        "launch_id": pa.array(launch_id, mask=launch_id < 0),
        "args": cols.column("args"),
    }
    schema = arrow_schema(TraceEvent)
    table = pa.table(
        {
            f.name: pa.array(columns[f.name], f.type)
            if not isinstance(columns[f.name], pa.ChunkedArray)
            else columns[f.name].cast(f.type)
            for f in schema
        },
        schema=schema,
    )
    return TraceTables(events=table, steps=steps)


def _launching_ops(
    category: np.ndarray[Any, Any],
    correlation: pa.ChunkedArray,
    parent: np.ndarray[Any, Any],
    on_device: np.ndarray[Any, Any],
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """For each device event, the index of the ``cpu_op`` that launched it (-1 when unknown)."""
    n = len(category)
    out = np.full(n, -1, dtype=np.int64)
    corr = correlation.to_numpy(zero_copy_only=False)
    corr = (
        np.where(np.isnan(corr), -1, corr).astype(np.int64)
        if corr.dtype.kind == "f"
        else corr.astype(np.int64)
    )
    launch = np.isin(category, list(LAUNCH_CATEGORIES)) & (corr >= 0)
    device = on_device & (corr >= 0)
    if not launch.any() or not device.any():
        return out
    # innermost cpu_op at or above every event, filled from the roots down
    op_above = np.where(category == HOST_OP_CATEGORY, np.arange(n), -1)
    for level in depth_levels(parent)[1:]:
        own = op_above[level] >= 0
        inherit = level[~own]
        op_above[inherit] = op_above[parent[inherit]]
    launches = np.flatnonzero(launch)
    order = np.argsort(corr[launches], kind="stable")
    keys = corr[launches][order]
    targets = np.flatnonzero(device)
    k = np.searchsorted(keys, corr[targets])
    found = (k < len(keys)) & (keys[np.minimum(k, len(keys) - 1)] == corr[targets])
    runtime = launches[order][np.minimum(k, len(keys) - 1)]
    out[targets[found]] = op_above[runtime[found]]
    return out


def steps_table(steps: Sequence[StepSpan], run_id: str, rank: int = 0) -> pa.Table:
    cols: dict[str, Any] = {
        "run_id": [run_id] * len(steps),
        "step": [s.step for s in steps],
        "start_ns": [s.start_ns for s in steps],
        "dur_ns": [s.dur_ns for s in steps],
        "kind": [s.kind for s in steps],
        "input_shapes": [s.input_shapes for s in steps],
        "rank": [rank] * len(steps),
    }
    return pa.table(cols, schema=arrow_schema(Step))
