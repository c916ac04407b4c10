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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from google.protobuf.message import DecodeError

from tpudiag.analysis.step_summary import StepSpan
from tpudiag.analysis.steps import detect_steps, step_array
from tpudiag.analysis.tree import nest_arrays
from tpudiag.errors import ImportFormatError
from tpudiag.model import TraceEvent, arrow_schema
from tpudiag.traces import decodepool, xplane_columns, xplane_events

# Events DB category (the XLine name on device planes) -> our category.
DEVICE_LINE_CATEGORIES = {
    "XLA Ops": "xla_op",
    "XLA Modules": "xla_module",
    "Async XLA Ops": "xla_async_op",  # async copies and collectives, overlapping the ops line: not busy time
    "Steps": "xla_step",
    "device": "kernel",  # GPU stream events
}
HOST_OP_CATEGORY = "cpu_op"
HOST_XLA_OP_CATEGORY = "xla_host_op"  # an HLO op run by XLA's CPU runtime on a host thread
_HLO_OP = re.compile(r"(?:^|,)hlo_op=[^,]")
_STEP_NUM = re.compile(r"(?:^|,)step_num=(\d+)")
_TRAILING_INT = re.compile(r"(\d+)$")
_HLO_CATEGORY = re.compile(r"(?:^|,)hlo_category=([^,]*)")
_PYTHON_FRAME = "$"
_NAME_TYPE = re.compile(r"^(.*[^:]):([^:]+)$")
PARALLEL_MIN_BYTES = 4 << 20  # smaller files are read in-process (forking a worker would cost more than it saves)


@dataclass(frozen=True)
class XPlaneTables:
    events: pa.Table
    steps: list[StepSpan]
    devices: list[str] = field(default_factory=list)  # device names of the on-device events ("TPU:0", ...)


def load(path: Path, run_id: str, rank: int = 0, first_event_id: int = 0, parallel: bool = False) -> XPlaneTables:
    """Parse one XSpace file in-process and map its events to trace_events rows.

    ``parallel``: a large file's later planes (about half its bytes) are decoded, nested and given their args by a
    forked second process meanwhile (for a short-lived process that owns its threads, like the import command).
    Any failure there does it all here, so rows and errors are the in-process ones."""
    data = _read_bytes(path)
    host = host_of(path)
    prepared = None
    try:
        planes = xplane_events.planes_of(data)
        if parallel and len(data) >= PARALLEL_MIN_BYTES and len(planes) >= 2 and decodepool.fork_available():
            decodepool.keep_freed_memory()
            try:
                events, prepared = _read_parallel(planes, host)
            except decodepool.WorkerError:
                events = xplane_events.read_planes(planes)
        else:
            events = xplane_events.read_planes(planes)
    except DecodeError as err:
        raise ImportFormatError(f"{path}: not a readable XPlane file ({err})") from None
    _check(path, events)
    return to_tables(events, run_id, rank=rank, first_event_id=first_event_id, host=host, prepared=prepared)


def read_columns(path: Path) -> xplane_columns.EventColumns:
    """XSpace file -> its events; an empty, truncated or corrupt file is one ImportFormatError."""
    data = _read_bytes(path)
    try:
        events = xplane_events.read(data)
    except DecodeError as err:
        raise ImportFormatError(f"{path}: not a readable XPlane file ({err})") from None
    _check(path, events)
    return events


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    if not data:
        raise ImportFormatError(f"{path}: empty file")
    return data


def _check(path: Path, events: xplane_columns.EventColumns) -> None:
    if events.num_rows == 0:
        raise ImportFormatError(f"{path}: not a readable XPlane file (no trace events in it)")


def read_events(path: Path) -> pa.Table:
    """XSpace file -> Events-DB-shaped table (one row per event)."""
    return read_columns(path).table()


def host_of(path: Path) -> str:
    """``<host>[_<rank>].xplane.pb`` -> host name."""
    return path.name.removesuffix(".pb").removesuffix(".xplane").removesuffix(".xspace")


@dataclass(frozen=True)
class Prepared:
    """What ``to_tables`` computes per thread or per group, for some planes (``prepare``, joined by ``_join``)."""

    parent: np.ndarray[Any, Any]  # per event: index of its parent event (-1: none)
    depth: np.ndarray[Any, Any]
    hlo_category: Coded  # per group
    args: Coded  # per group


def prepare(ev: xplane_columns.EventColumns, host: str) -> Prepared:
    """Nesting (per thread), HLO category and args (per group) of these events."""
    k = _Kinds.of(ev, host)
    threads: dict[tuple[str, str], int] = {}
    thread_code = np.array(
        [threads.setdefault(t, len(threads)) for t in zip(k.process, k.thread, strict=True)], dtype=np.int64
    )
    parent, depth, _ = nest_arrays(thread_code[ev.kind], ev.start_ns, np.maximum(ev.end_ns - ev.start_ns, 0))
    on_device_g = k.on_device[ev.group_kind] if len(ev.group_kind) else ev.group_kind.astype(bool)
    return Prepared(parent, depth, Coded.of(_hlo_category(ev, on_device_g)), Coded.of(_args(ev)))


def _join(head: Prepared, tail: Prepared) -> Prepared:
    """``prepare`` of ``concatenate(head events, tail events)`` when no thread has events in both."""
    offset = len(head.parent)
    return Prepared(
        parent=np.concatenate((head.parent, np.where(tail.parent < 0, -1, tail.parent + offset))),
        depth=np.concatenate((head.depth, tail.depth)),
        hlo_category=head.hlo_category.then(tail.hlo_category),
        args=head.args.then(tail.args),
    )


def _read_parallel(planes: list[Any], host: str) -> tuple[xplane_columns.EventColumns, Prepared | None]:
    """The planes from the byte midpoint on read (and prepared, when they share no device with the others) by a
    forked worker, which inherits ``planes``; the rest here meanwhile."""
    split = xplane_events.split_point(planes)
    devices = [{xplane_events.device_of(p.name) for p in part} for part in (planes[:split], planes[split:])]
    separate = devices[0].isdisjoint(devices[1])  # no thread spans both parts: nesting splits too

    def part(which: list[Any]) -> tuple[xplane_columns.EventColumns, Prepared | None]:
        ev = xplane_events.read_planes(which)
        return ev, prepare(ev, host) if separate else None

    with decodepool.DecodeWorker(lambda _: part(planes[split:])) as worker:
        worker.submit(b"")
        try:
            head = part(planes[:split])
        except Exception:  # the in-process read raises the same error; the worker's answer is not needed
            worker.kill()
            raise decodepool.WorkerError("a plane did not decode") from None
        tail = worker.result()
    events = xplane_columns.concatenate(head[0], tail[0])
    return events, _join(head[1], tail[1]) if head[1] is not None and tail[1] is not None else None


@dataclass(frozen=True)
class _Kinds:
    """Per-kind columns."""

    line_cat: list[str]
    kernel: list[str]
    on_device: np.ndarray[Any, Any]
    process: list[str]
    thread: list[str]

    @classmethod
    def of(cls, ev: xplane_columns.EventColumns, host: str) -> _Kinds:
        g = ev.kinds
        line_cat: list[str] = [c or "" for c in g["category"]]
        on_device = np.array([c in DEVICE_LINE_CATEGORIES for c in line_cat], dtype=bool)
        thread = [
            (c if c != "device" else f"stream {sid}") if dev else (tname or str(tid))
            for dev, c, sid, tname, tid in zip(
                on_device.tolist(), line_cat, g["stream_id"], g["thread_name"], g["thread_id"], strict=True
            )
        ]
        return cls(
            line_cat=line_cat,
            kernel=[k or "" for k in g["kernel_name"]],
            on_device=on_device,
            process=[f"{host}:{d or ''}" if host else (d or "") for d in g["device"]],
            thread=thread,
        )


def to_tables(
    ev: xplane_columns.EventColumns,
    run_id: str,
    rank: int = 0,
    first_event_id: int = 0,
    host: str = "",
    prepared: Prepared | None = None,
) -> XPlaneTables:
    """Events -> trace_events rows (categories, nesting, steps) and step spans.

    Every column but the times, nesting and steps is computed once per event kind (args and HLO category once per
    group) and expanded with numpy.  ``prepared``: ``prepare(ev, host)``, when already computed.
    """
    g = ev.kinds
    kind = ev.kind
    group = ev.group
    n = ev.num_rows
    k = _Kinds.of(ev, host)
    line_cat, kernel, on_device_k, process, thread = k.line_cat, k.kernel, k.on_device, k.process, k.thread
    category = [
        DEVICE_LINE_CATEGORIES.get(c)
        or (HOST_OP_CATEGORY if tf_type else "python_function" if kn.startswith(_PYTHON_FRAME) else "host")
        for c, tf_type, kn in zip(line_cat, g["tf_op_type"], kernel, strict=True)
    ]
    name = [h if dev and h else kn for dev, h, kn in zip(on_device_k.tolist(), g["hlo_op"], kernel, strict=True)]
    prep = prepared or prepare(ev, host)
    parent, depth = prep.parent, prep.depth
    start, end = ev.start_ns, ev.end_ns
    dur = np.maximum(end - start, 0)
    on_device = on_device_k[kind]
    name_column = _strings(name, kind)
    steps = _steps(ev, line_cat, kernel, start, dur, parent, name_column)
    columns: dict[str, pa.Array] = {
        "run_id": _strings([run_id], np.zeros(n, dtype=np.int32)),
        "event_id": pa.array(np.arange(first_event_id, first_event_id + n, dtype=np.int64)),
        "source": _strings(["xplane"], np.zeros(n, dtype=np.int32)),
        "process": _strings(process, kind),
        "thread": _strings(thread, kind),
        "name": name_column,
        "category": _strings(_group_categories(ev, category), group),
        "start_ns": pa.array(start),
        "dur_ns": pa.array(dur),
        "self_ns": pa.array(np.where(on_device, ev.self_time_ns, _host_self(parent, dur))),
        "depth": pa.array(depth),
        "parent_id": pa.array(parent + first_event_id, mask=parent < 0),
        "rank": pa.array(np.full(n, rank, dtype=np.int64)),
        "step": _step_numbers(ev, start, steps),
        "correlation": _numbers(g["correlation_id"], kind, pa.int64()),
        "on_device": pa.array(on_device),
        "flops": _numbers(g["flops"], kind, pa.float64()),
        "bytes_accessed": _numbers(g["memory_accessed"], kind, pa.float64()),
        "framework_op": _strings(
            [_framework_op(t) if dev else None for dev, t in zip(on_device_k.tolist(), g["tf_op_name"], strict=True)],
            kind,
        ),
        "hlo_category": prep.hlo_category.expand(group),
        "args": prep.args.expand(group),
    }
    schema = arrow_schema(TraceEvent)
    arrays = [columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in schema]
    table = pa.Table.from_arrays(
        arrays, schema=pa.schema([pa.field(f.name, a.type) for f, a in zip(schema, arrays, strict=True)])
    )
    devices = {p.split(":", 1)[-1] for p, dev in zip(process, on_device_k.tolist(), strict=True) if dev}
    return XPlaneTables(events=table, steps=steps, devices=sorted(devices))


def _group_categories(ev: xplane_columns.EventColumns, kind_category: list[str]) -> list[str | None]:
    """Category of each group: its kind's, except host events that XLA's CPU (or GPU host) runtime stamps with the
    HLO op they run (an ``hlo_op`` stat: ``fusion.3`` on a ``tf_XLAEigen/...`` thread), which are the program's ops.
    The stat is looked for in the kind's and the group's own pairs apart (no per-group string is built)."""
    kind_hlo = [bool(a) and _has_hlo_op(a) for a in ev.kinds["trace_args"]]
    own_hlo = [_has_hlo_op(a) for a in ev.own_pairs]
    out: list[str | None] = []
    for k, o in zip(ev.group_kind.tolist(), ev.group_own.tolist(), strict=True):
        cat = kind_category[k]
        out.append(HOST_XLA_OP_CATEGORY if cat == "host" and (kind_hlo[k] or (o >= 0 and own_hlo[o])) else cat)
    return out


def _has_hlo_op(pairs: str) -> bool:
    return "hlo_op=" in pairs and _HLO_OP.search(pairs) is not None


def _strings(values: Sequence[str | None], group: np.ndarray[Any, Any]) -> pa.Array:
    """Per-group (or per-kind) strings expanded to one per event, as a dictionary array (null for None)."""
    return Coded.of(values).expand(group)


@dataclass(frozen=True)
class Coded:
    """Strings (None allowed) as their distinct values in first-seen order and one code per string (-1: None)."""

    values: list[str]
    codes: np.ndarray[Any, Any]  # int32

    @classmethod
    def of(cls, strings: Sequence[str | None]) -> Coded:
        index: dict[str, int] = {}
        codes = np.array([-1 if v is None else index.setdefault(v, len(index)) for v in strings], dtype=np.int32)
        return cls(list(index), codes)

    def then(self, other: Coded) -> Coded:
        """These strings followed by ``other``'s, coded as ``Coded.of`` codes them all at once."""
        index = {v: i for i, v in enumerate(self.values)}
        remap = np.array([index.setdefault(v, len(index)) for v in other.values] + [-1], dtype=np.int32)
        return Coded(list(index), np.concatenate((self.codes, remap[other.codes])))

    def expand(self, group: np.ndarray[Any, Any]) -> pa.Array:
        """The string of each event's group (``group``: codes' positions), as a dictionary array."""
        codes = self.codes
        per_event = codes[group] if len(codes) else codes
        missing = codes < 0
        indices = pa.array(per_event, mask=missing[group]) if missing.any() else pa.array(per_event)
        return pa.DictionaryArray.from_arrays(indices, pa.array(self.values or [""], pa.string()))


def _hlo_category(ev: xplane_columns.EventColumns, on_device: np.ndarray[Any, Any]) -> list[str | None]:
    """``hlo_category`` of each device group: the first in its trace_args (its kind's pairs, then its own)."""
    kinds = [_first_hlo_category(a) for a in ev.kinds["trace_args"]]
    owns = [_first_hlo_category(a) for a in ev.own_pairs]
    return [
        None if not dev else kinds[k] if kinds[k] is not None or o < 0 else owns[o]
        for dev, k, o in zip(on_device.tolist(), ev.group_kind.tolist(), ev.group_own.tolist(), strict=True)
    ]


def _first_hlo_category(trace_args: str | None) -> str | None:
    m = _HLO_CATEGORY.search(trace_args or "")
    return m.group(1) if m else None


def _numbers(values: list[Any], group: np.ndarray[Any, Any], typ: pa.DataType) -> pa.Array:
    """Per-group numbers (None -> null) expanded to one per event."""
    dtype = np.int64 if pa.types.is_integer(typ) else np.float64
    missing = np.array([v is None for v in values], dtype=bool)
    known = np.array([0 if v is None else v for v in values], dtype=dtype)
    return pa.array(known[group], typ, mask=missing[group])


def _framework_op(tf_op: str | None) -> str | None:
    """``aten::addmm:addmm`` (XLA's ``name:type`` form) -> ``aten::addmm``."""
    if not tf_op:
        return None
    m = _NAME_TYPE.match(tf_op)
    # JAX writes an op with no type as ``jit(f)/jit(main)/add:``: the name without its empty type.
    return m.group(1) if m else tf_op.removesuffix(":") or tf_op


def _host_self(parent: np.ndarray[Any, Any], dur: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    child = np.bincount(parent[parent >= 0], weights=dur[parent >= 0], minlength=len(dur)).astype(np.int64)
    return np.maximum(dur - child, 0)


def _events_of(codes: np.ndarray[Any, Any], marked: list[bool]) -> list[int]:
    """Indices (in order) of the events whose code (kind or group) is marked."""
    if not any(marked):
        return []
    return np.flatnonzero(np.asarray(marked, dtype=bool)[codes]).tolist()


def _steps(
    ev: xplane_columns.EventColumns,
    line_cat: list[str],
    kernel: list[str],
    start: np.ndarray[Any, Any],
    dur: np.ndarray[Any, Any],
    parent: np.ndarray[Any, Any],
    name: pa.Array,
) -> list[StepSpan]:
    """Device ``Steps`` line first, then host step annotations (``step_num=N``), then torch's own rules."""
    spans: dict[int, StepSpan] = {}
    kind = ev.kind
    for i in _events_of(kind, [c == "Steps" for c in line_cat]):
        num = _step_number(kernel[kind[i]])
        num = len(spans) if num is None else num
        if num not in spans:
            spans[num] = StepSpan(num, int(start[i]), int(dur[i]), "device_step")
    if not spans:
        step_num = [_step_number(a or "", _STEP_NUM) for a in ev.trace_args]
        for i in _events_of(ev.group, [num is not None for num in step_num]):
            num = step_num[ev.group[i]]
            if num is not None and num not in spans:
                spans[num] = StepSpan(num, int(start[i]), int(dur[i]), "profiler_step")
    if spans:
        return [spans[k] for k in sorted(spans)]
    return detect_steps(name, start, dur, parent) if len(name) else []


def _step_number(text: str, pattern: re.Pattern[str] = _TRAILING_INT) -> int | None:
    """The step number in ``text`` (trailing digits, or ``step_num=N``); None if absent or beyond int64."""
    m = pattern.search(text)
    value = int(m.group(1)) if m else None
    return value if value is not None and value < 2**63 else None


def _step_numbers(ev: xplane_columns.EventColumns, start: np.ndarray[Any, Any], steps: list[StepSpan]) -> pa.Array:
    """The number in the event's step name (``step:12``), else the step whose interval holds its start."""
    by_time = step_array(start, steps).to_numpy(zero_copy_only=False)
    missing = np.isnan(by_time) if by_time.dtype.kind == "f" else np.zeros(len(by_time), dtype=bool)
    value = np.where(missing, 0, by_time).astype(np.int64)
    named = [_step_number(s) for s in ev.step_names]
    has = np.array([m is not None for m in named] + [False], dtype=bool)
    num = np.array([m or 0 for m in named] + [0], dtype=np.int64)
    code = np.where(ev.step_code < 0, len(named), ev.step_code)
    from_name = has[code]
    return pa.array(np.where(from_name, num[code], value), pa.int64(), mask=~from_name & missing)


# Events DB columns that go into args (the reader leaves hlo_fingerprint, flow and output_tensors empty).
_ARG_COLUMNS = ("hlo_module", "kernel_details", "tf_op_type")
_JSON = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps with options builds one per call


def _args(ev: xplane_columns.EventColumns) -> list[str | None]:
    """The args JSON of each group: its kind's columns above, then the ``key=value`` pairs of its trace_args.

    Built from the kind's JSON and the own pairs' JSON where their keys do not overlap (the common case: a
    per-step ``group_id``), else from the group's whole trace_args.
    """
    kinds = [
        _pairs({c: ev.kinds[c][k] for c in _ARG_COLUMNS if ev.kinds[c][k] is not None}, ev.kinds["trace_args"][k])
        for k in range(len(ev.kinds["device"]))
    ]
    kind_json = [_JSON.encode(d) if d else None for d in kinds]
    owns = [_pairs({}, pairs) for pairs in ev.own_pairs]
    own_items = [_JSON.encode(d)[1:] for d in owns]  # '"key":"value",...}'
    out: list[str | None] = []
    for k, o in zip(ev.group_kind.tolist(), ev.group_own.tolist(), strict=True):
        if o < 0 or not owns[o]:
            out.append(kind_json[k])
        elif kind_json[k] is None:
            out.append("{" + own_items[o])
        elif kinds[k].keys().isdisjoint(owns[o]):
            out.append(f"{kind_json[k][:-1]},{own_items[o]}")
        else:
            out.append(_JSON.encode(_pairs(dict(kinds[k]), ev.own_pairs[o])))
    return out


def _pairs(d: dict[str, Any], trace_args: str | None) -> dict[str, Any]:
    """``d`` updated with the ``key=value`` pairs of a trace_args text."""
    if trace_args:
        for part in trace_args.split(","):
            key, sep, value = part.partition("=")
            if sep:
                d[key] = value
    return d
