"""XPlane (``*.xplane.pb``: TorchTPU, JAX, XProf captures) into trace_events rows.

The XSpace is parsed in-process with the descriptor-built protobuf classes (``xplane_proto``) and flattened by
``xplane_events`` into the table xprof's Events DB would give (host threads, TPU lines ``XLA Ops`` with HLO op,
framework op, FLOPs and bytes, ``XLA Modules``, ``Steps``, GPU streams with launch correlation ids); this module
maps that table to trace_events rows.  A corrupt file is a protobuf DecodeError, which becomes one clear error
naming the file.  Host times are kept as the file gives them (relative for jax CPU traces), per file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from google.protobuf.message import DecodeError

from tpudiag.analysis.steps import StepSpan, assign_steps, detect_steps
from tpudiag.analysis.tree import nest_arrays, thread_codes
from tpudiag.errors import ImportFormatError
from tpudiag.model import TraceEvent, arrow_schema
from tpudiag.traces import xplane_events, xplane_proto

# Events DB category (the XLine name on device planes) -> our category.
DEVICE_LINE_CATEGORIES = {
    "XLA Ops": "xla_op",
    "XLA Modules": "xla_module",
    "Steps": "xla_step",
    "device": "kernel",  # GPU stream events
}
HOST_OP_CATEGORY = "cpu_op"
_STEP_NUM = re.compile(r"(?:^|,)step_num=(\d+)")
_TRAILING_INT = re.compile(r"(\d+)$")
_HLO_CATEGORY = re.compile(r"(?:^|,)hlo_category=([^,]*)")
_PYTHON_FRAME = "$"
_NAME_TYPE = re.compile(r"^(.*[^:]):([^:]+)$")


@dataclass(frozen=True)
class XPlaneTables:
    events: pa.Table
    steps: list[StepSpan]


def load(path: Path, run_id: str, rank: int = 0, first_event_id: int = 0) -> XPlaneTables:
    """Parse one XSpace file in-process and map its events to trace_events rows."""
    return to_tables(read_events(path), run_id, rank=rank, first_event_id=first_event_id, host=host_of(path))


def read_events(path: Path) -> pa.Table:
    """XSpace file -> Events-DB-shaped table; an empty, truncated or corrupt file is one ImportFormatError."""
    data = path.read_bytes()
    if not data:
        raise ImportFormatError(f"{path}: empty file")
    try:
        space = xplane_proto.parse_xspace(data)
    except DecodeError as err:
        raise ImportFormatError(f"{path}: not a readable XPlane file ({err})") from None
    table = xplane_events.events_table(space)
    if table.num_rows == 0:
        raise ImportFormatError(f"{path}: not a readable XPlane file (no trace events in it)")
    return table


def host_of(path: Path) -> str:
    """``<host>[_<rank>].xplane.pb`` -> host name."""
    return path.name.removesuffix(".pb").removesuffix(".xplane").removesuffix(".xspace")


def to_tables(raw: pa.Table, run_id: str, rank: int = 0, first_event_id: int = 0, host: str = "") -> XPlaneTables:
    """Events DB rows -> trace_events rows (categories, nesting, steps) and step spans."""
    n = raw.num_rows
    device: list[str] = [d or "" for d in raw.column("device").to_pylist()]
    line_cat: list[str] = [c or "" for c in raw.column("category").to_pylist()]
    thread_name = raw.column("thread_name").to_pylist()
    thread_id = raw.column("thread_id").to_pylist()
    stream_id = raw.column("stream_id").to_pylist()
    kernel = raw.column("kernel_name").to_pylist()
    hlo_op = raw.column("hlo_op").to_pylist()
    tf_op = raw.column("tf_op_name").to_pylist()
    tf_type = raw.column("tf_op_type").to_pylist()
    trace_args = raw.column("trace_args").to_pylist()
    step_names = raw.column("step").to_pylist()

    on_device = np.array([c in DEVICE_LINE_CATEGORIES for c in line_cat], dtype=bool)
    category = [
        DEVICE_LINE_CATEGORIES.get(c)
        or (
            HOST_OP_CATEGORY
            if tf_type[i]
            else "python_function"
            if (kernel[i] or "").startswith(_PYTHON_FRAME)
            else "host"
        )
        for i, c in enumerate(line_cat)
    ]
    name = [hlo_op[i] if on_device[i] and hlo_op[i] else (kernel[i] or "") for i in range(n)]
    thread = [
        (c if on_device[i] and c != "device" else f"stream {stream_id[i]}")
        if on_device[i]
        else (thread_name[i] or str(thread_id[i]))
        for i, c in enumerate(line_cat)
    ]
    process = [f"{host}:{d}" if host else d for d in device]
    start = pc.cast(raw.column("start_ns"), pa.int64()).to_numpy()
    end = pc.cast(raw.column("end_ns"), pa.int64()).to_numpy()
    dur = np.maximum(end - start, 0)
    parent, depth, _ = nest_arrays(thread_codes(list(zip(process, thread, strict=True))), start, dur)
    self_ns = pc.cast(raw.column("self_time_ns"), pa.int64()).to_numpy(zero_copy_only=False)

    steps = _steps(kernel, trace_args, line_cat, start, dur, parent, name)
    step_of = _step_numbers(step_names, start, steps)
    hlo_category = [
        (m.group(1) if (m := _HLO_CATEGORY.search(a or "")) else None) if on_device[i] else None
        for i, a in enumerate(trace_args)
    ]
    args = _args_column(raw, trace_args)
    shapes = [json.dumps(t) if t else None for t in raw.column("input_tensors").to_pylist()]
    memory = pc.cast(raw.column("memory_accessed"), pa.float64())
    columns: dict[str, Any] = {
        "run_id": [run_id] * n,
        "event_id": np.arange(first_event_id, first_event_id + n, dtype=np.int64),
        "source": ["xplane"] * n,
        "process": process,
        "thread": thread,
        "name": name,
        "category": category,
        "start_ns": start,
        "dur_ns": dur,
        "self_ns": np.where(on_device, self_ns, _host_self(parent, dur)),
        "depth": depth,
        "parent_id": pa.array(parent + first_event_id, mask=parent < 0),
        "rank": np.full(n, rank, dtype=np.int64),
        "step": pa.array(step_of, pa.int64()),
        "module": [None] * n,
        "phase": [None] * n,
        "source_loc": raw.column("source_line"),
        "shapes": shapes,
        "dtypes": [None] * n,
        "seq_nr": [None] * n,
        "external_id": [None] * n,
        "correlation": pc.cast(raw.column("correlation_id"), pa.int64()),
        "on_device": on_device,
        "flops": pc.cast(raw.column("flops"), pa.float64()),
        "bytes_accessed": memory,
        "framework_op": [_framework_op(tf_op[i]) if on_device[i] else None for i in range(n)],
        "hlo_category": hlo_category,
        "launch_id": [None] * n,
        "args": args,
    }
    schema = arrow_schema(TraceEvent)
    table = pa.table({f.name: _as_array(columns[f.name], f.type) for f in schema}, schema=schema)
    return XPlaneTables(events=table, steps=steps)


def _framework_op(tf_op: str | None) -> str | None:
    """``aten::addmm:addmm`` (XLA's ``name:type`` form) -> ``aten::addmm``."""
    if not tf_op:
        return None
    m = _NAME_TYPE.match(tf_op)
    return m.group(1) if m else tf_op


def _as_array(value: Any, typ: pa.DataType) -> pa.Array | pa.ChunkedArray:
    if isinstance(value, pa.ChunkedArray):
        return value.cast(typ)
    return pa.array(value, typ)


def _host_self(parent: np.ndarray[Any, Any], dur: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    child = np.bincount(parent[parent >= 0], weights=dur[parent >= 0], minlength=len(dur)).astype(np.int64)
    return np.maximum(dur - child, 0)


def _steps(
    kernel: list[str | None],
    trace_args: list[str | None],
    line_cat: list[str],
    start: np.ndarray[Any, Any],
    dur: np.ndarray[Any, Any],
    parent: np.ndarray[Any, Any],
    name: list[str],
) -> list[StepSpan]:
    """Device ``Steps`` line first, then host step annotations (``step_num=N``), then torch's own rules."""
    spans: dict[int, StepSpan] = {}
    for i, c in enumerate(line_cat):
        if c == "Steps":
            m = _TRAILING_INT.search(kernel[i] or "")
            num = int(m.group(1)) if m else len(spans)
            if num not in spans:
                spans[num] = StepSpan(num, int(start[i]), int(dur[i]), "device_step")
    if not spans:
        for i, a in enumerate(trace_args):
            m = _STEP_NUM.search(a or "")
            if m and int(m.group(1)) not in spans:
                spans[int(m.group(1))] = StepSpan(int(m.group(1)), int(start[i]), int(dur[i]), "profiler_step")
    if spans:
        return [spans[k] for k in sorted(spans)]
    return detect_steps(name, start, dur, parent) if len(name) else []


def _step_numbers(step_names: list[str | None], start: np.ndarray[Any, Any], steps: list[StepSpan]) -> list[Any]:
    by_time = assign_steps(start, steps)
    out: list[Any] = []
    for i, s in enumerate(step_names):
        m = _TRAILING_INT.search(s) if s else None
        out.append(int(m.group(1)) if m else by_time[i])
    return out


_ARG_COLUMNS = ("hlo_module", "kernel_details", "tf_op_type", "hlo_fingerprint", "flow", "output_tensors")


def _args_column(raw: pa.Table, trace_args: list[str | None]) -> list[str | None]:
    extra = {c: raw.column(c).to_pylist() for c in _ARG_COLUMNS}
    out: list[str | None] = []
    for i, a in enumerate(trace_args):
        d: dict[str, Any] = {k: v[i] for k, v in extra.items() if v[i] is not None}
        if a:
            for part in a.split(","):
                key, sep, value = part.partition("=")
                if sep:
                    d[key] = value
        out.append(json.dumps(d, separators=(",", ":")) if d else None)
    return out
