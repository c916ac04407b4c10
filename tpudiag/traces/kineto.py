"""Kineto / Chrome trace-event JSON (torch.profiler's ``export_chrome_trace``) into trace_events rows.

Timestamps: ``ts``/``dur`` are microseconds; Kineto adds ``baseTimeNanoseconds`` so that
``epoch_ns = baseTimeNanoseconds + ts * 1000``.  Only complete events (``ph == "X"``) become rows; metadata
events give process and thread names.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from tpudiag.analysis.steps import StepSpan, assign_steps, detect_steps
from tpudiag.analysis.tree import attribute_modules, nest
from tpudiag.errors import ImportFormatError
from tpudiag.model import Step, TraceEvent, arrow_schema

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
_PROMOTED_ARGS = ("Input Dims", "Input type", "Sequence number", "External id", "correlation")


@dataclass
class KinetoTrace:
    """The complete events of one Chrome trace file, as columns."""

    base_ns: int
    process: list[str] = field(default_factory=list)
    thread: list[str] = field(default_factory=list)
    name: list[str] = field(default_factory=list)
    category: list[str] = field(default_factory=list)
    start_ns: list[int] = field(default_factory=list)
    dur_ns: list[int] = field(default_factory=list)
    args: list[dict[str, Any] | None] = field(default_factory=list)
    process_names: dict[str, str] = field(default_factory=dict)
    thread_names: dict[tuple[str, str], str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.name)


def read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as err:
            raise ImportFormatError(f"{path}: truncated or corrupt gzip ({err})") from None
    return data


def load(path: Path) -> KinetoTrace:
    raw = read_bytes(path)
    try:
        doc = msgspec.json.decode(raw)
    except msgspec.DecodeError as err:
        raise ImportFormatError(f"{path}: not valid trace JSON ({err})") from None
    return parse(doc, str(path))


def parse(doc: Any, origin: str = "<trace>") -> KinetoTrace:
    if isinstance(doc, list):
        events, base = doc, 0
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events = doc["traceEvents"]
        base = int(doc.get("baseTimeNanoseconds") or 0)
    else:
        raise ImportFormatError(f"{origin}: no traceEvents list: not a Chrome/Kineto trace")
    t = KinetoTrace(base_ns=base)
    for ev in events:
        if not isinstance(ev, dict):
            continue
        ph = ev.get("ph")
        if ph == "X":
            try:
                ts = float(ev["ts"])
                dur = float(ev.get("dur", 0) or 0)
            except (KeyError, TypeError, ValueError):
                continue
            t.process.append(str(ev.get("pid", "")))
            t.thread.append(str(ev.get("tid", "")))
            t.name.append(str(ev.get("name", "")))
            t.category.append(str(ev.get("cat", "")))
            t.start_ns.append(base + round(ts * 1000))
            t.dur_ns.append(max(0, round(dur * 1000)))
            a = ev.get("args")
            t.args.append(a if isinstance(a, dict) else None)
        elif ph == "M":
            a = ev.get("args") or {}
            if ev.get("name") == "process_name" and isinstance(a, dict):
                t.process_names[str(ev.get("pid", ""))] = str(a.get("name", ""))
            elif ev.get("name") == "thread_name" and isinstance(a, dict):
                t.thread_names[(str(ev.get("pid", "")), str(ev.get("tid", "")))] = str(a.get("name", ""))
    return t


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


@dataclass(frozen=True)
class TraceTables:
    events: pa.Table
    steps: list[StepSpan]


def to_tables(
    trace: KinetoTrace,
    run_id: str,
    rank: int = 0,
    first_event_id: int = 0,
    module_sources: dict[str, str] | None = None,
    root_inputs: Sequence[str | None] = (),
    source: str = "kineto",
) -> TraceTables:
    """Analyse one trace (nesting, self time, modules, steps) and build its trace_events table."""
    n = len(trace)
    threads = list(zip(trace.process, trace.thread, strict=True))
    tree = nest(threads, trace.start_ns, trace.dur_ns)
    seq = [_int_or_none(a.get("Sequence number")) if a else None for a in trace.args]
    attr = attribute_modules(trace.name, trace.process, trace.start_ns, seq, tree.parent, module_sources)
    steps = detect_steps(trace.name, trace.start_ns, trace.dur_ns, tree.parent, root_inputs)
    step_of = assign_steps(trace.start_ns, steps)

    shapes: list[str | None] = []
    dtypes: list[str | None] = []
    external: list[int | None] = []
    correlation: list[int | None] = []
    rest: list[str | None] = []
    for a in trace.args:
        if not a:
            shapes.append(None)
            dtypes.append(None)
            external.append(None)
            correlation.append(None)
            rest.append(None)
            continue
        dims = a.get("Input Dims")
        shapes.append(json.dumps(dims, separators=(",", ":")) if dims is not None else None)
        types = a.get("Input type")
        dtypes.append(json.dumps(types, separators=(",", ":")) if types is not None else None)
        external.append(_int_or_none(a.get("External id")))
        correlation.append(_int_or_none(a.get("correlation")))
        others = {k: v for k, v in a.items() if k not in _PROMOTED_ARGS}
        rest.append(json.dumps(others, separators=(",", ":"), default=str) if others else None)

    proc_label = [trace.process_names.get(p, p) for p in trace.process]
    thread_label = [trace.thread_names.get(th, th[1]) for th in threads]
    ids = list(range(first_event_id, first_event_id + n))
    columns: dict[str, Any] = {
        "run_id": [run_id] * n,
        "event_id": ids,
        "source": [source] * n,
        "process": proc_label,
        "thread": thread_label,
        "name": trace.name,
        "category": trace.category,
        "start_ns": trace.start_ns,
        "dur_ns": trace.dur_ns,
        "self_ns": tree.self_ns,
        "depth": tree.depth,
        "parent_id": [first_event_id + p if p >= 0 else None for p in tree.parent],
        "rank": [rank] * n,
        "step": step_of,
        "module": attr.module,
        "phase": attr.phase,
        "source_loc": attr.source_loc,
        "shapes": shapes,
        "dtypes": dtypes,
        "seq_nr": seq,
        "external_id": external,
        "correlation": correlation,
        "on_device": [c in DEVICE_CATEGORIES for c in trace.category],
        "flops": [None] * n,
        "bytes_accessed": [None] * n,
        "args": rest,
    }
    table = pa.table(columns, schema=arrow_schema(TraceEvent))
    return TraceTables(events=table, steps=steps)


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
