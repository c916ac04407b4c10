"""An XSpace as an events table shaped like xprof's Events DB, decoded column-wise.

xprof's Events DB turns an XSpace into one row per XEvent; tpudiag used to run it in a child process (its native
code crashes on some inputs and clashes with duckdb).  Here the same columns are built in-process, resolving what
the Events DB resolves: event names (with its ``step:``/``HLO Module:`` prefixes on device lines), stats of the event
and of its metadata (``tf_op``, ``flops``, ``bytes_accessed``, ``program_id`` -> HLO module, ``correlation_id``,
``kernel_details``; the rest as ``trace_args`` ``key=value`` pairs), host threads (line name, id truncated to 32
bits) and device streams (line id).  Times are exact integers (ns): the Events DB goes through doubles and rounds
epoch timestamps to ~256 ns.

Speed: planes, lines and metadata are parsed by protobuf (``RawXSpace``), each line's events are left as bytes and
decoded column-wise (``protowire``).  Everything but the times depends only on the event's line, its metadata and
its own stats, so events are grouped by (line, metadata id, raw stat bytes) and those columns are computed once per
group: a TPU op that runs every step costs one group, not one Python step per call.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tpudiag.traces import protowire, xplane_proto

# Stats that become columns (not trace_args) on device lines, as in the Events DB.
_DEVICE_COLUMN_STATS = frozenset({"tf_op", "flops", "bytes_accessed", "correlation_id", "kernel_details"})
_U32 = 0xFFFFFFFF
Array = np.ndarray[Any, Any]
Stats = list[tuple[str, str | None]]

# Events DB columns fixed by an event's group (line, metadata, own stats), in the Events DB's order.
GROUP_COLUMNS: dict[str, pa.DataType] = {
    "device": pa.string(),
    "stream_id": pa.int64(),
    "thread_id": pa.int64(),
    "thread_name": pa.string(),
    "correlation_id": pa.int64(),
    "kernel_name": pa.string(),
    "kernel_details": pa.string(),
    "tf_op_name": pa.string(),
    "tf_op_type": pa.string(),
    "hlo_op": pa.string(),
    "hlo_module": pa.string(),
    "category": pa.string(),
    "flops": pa.float64(),
    "memory_accessed": pa.float64(),
    "trace_args": pa.string(),
}


@dataclass(frozen=True)
class EventColumns:
    """Events of an XSpace: per-group columns, and per event its group, times and step."""

    groups: dict[str, list[Any]]  # GROUP_COLUMNS, one entry per group
    group: Array  # int64 per event: index into groups
    start_ns: Array
    end_ns: Array
    self_time_ns: Array
    step_code: Array  # int64 per event: index into step_names, -1 for none
    step_names: list[str]

    @property
    def num_rows(self) -> int:
        return len(self.group)

    def group_table(self) -> pa.Table:
        return pa.table({c: pa.array(self.groups[c], typ) for c, typ in GROUP_COLUMNS.items()})

    def step(self) -> pa.Array:
        names = pa.array([*self.step_names, None], pa.string())
        return names.take(pa.array(np.where(self.step_code < 0, len(self.step_names), self.step_code)))

    def table(self) -> pa.Table:
        """One row per event, with the Events DB's columns."""
        n = self.num_rows
        out = self.group_table().take(pa.array(self.group))
        columns = dict(zip(out.column_names, out.columns, strict=True))
        columns["self_time_ns"] = pa.array(self.self_time_ns)
        columns["step"] = self.step()
        columns["start_ns"] = pa.array(self.start_ns)
        columns["end_ns"] = pa.array(self.end_ns)
        order = [*list(GROUP_COLUMNS)[:11], "self_time_ns", "step", *list(GROUP_COLUMNS)[11:], "start_ns", "end_ns"]
        table = pa.table({c: columns[c] for c in order})
        for c, typ in (("input_tensors", pa.list_(pa.string())), ("output_tensors", pa.list_(pa.string()))):
            table = table.append_column(c, pa.nulls(n, typ))
        for c in ("hlo_fingerprint", "flow"):
            table = table.append_column(c, pa.nulls(n, pa.uint64()))
        return table.append_column("source_line", pa.nulls(n, pa.string()))


def device_of(plane_name: str) -> str:
    """``/device:TPU:0`` -> ``TPU:0``; ``/host:CPU`` -> ``cpu:0``."""
    if plane_name.startswith("/device:"):
        return plane_name[len("/device:") :]
    if plane_name == "/host:CPU":
        return "cpu:0"
    return plane_name.lstrip("/")


def _stats(stats: Any, names: dict[int, str]) -> Stats:
    """(name, value as text) of each XStat; ``ref_value`` resolves to the referenced stat metadata's name."""
    out: Stats = []
    for s in stats:
        kind = s.WhichOneof("value")
        if kind == "ref_value":
            text: str | None = names.get(s.ref_value)
        elif kind == "str_value":
            text = s.str_value
        elif kind is None:
            text = None
        elif kind == "bytes_value":
            text = s.bytes_value.hex()
        else:
            text = str(getattr(s, kind))
        out.append((names.get(s.metadata_id, ""), text))
    return out


def read(data: bytes) -> EventColumns:
    """Serialized XSpace -> its events (``DecodeError`` when the bytes are not one)."""
    space = xplane_proto.parse_raw_xspace(data)
    acc = _Columns()
    for plane in space.planes:
        if plane.lines:
            _plane_rows(plane, acc)
    return acc.finish()


def events_table(data: bytes) -> pa.Table:
    """Serialized XSpace -> Events-DB-shaped Arrow table."""
    return read(data).table()


class _Columns:
    """Groups and per-event arrays of all planes, appended line by line."""

    def __init__(self) -> None:
        self.groups: dict[str, list[Any]] = {c: [] for c in GROUP_COLUMNS}
        self.parts: dict[str, list[Array]] = {c: [] for c in ("group", "start_ns", "end_ns", "self", "step")}
        self.step_index: dict[str, int] = {}

    def step_code(self, step: str | None) -> int:
        return -1 if step is None else self.step_index.setdefault(step, len(self.step_index))

    def finish(self) -> EventColumns:
        def cat(name: str) -> Array:
            parts = self.parts[name]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        return EventColumns(
            groups=self.groups,
            group=cat("group"),
            start_ns=cat("start_ns"),
            end_ns=cat("end_ns"),
            self_time_ns=cat("self"),
            step_code=cat("step"),
            step_names=list(self.step_index),
        )


@dataclass
class _Line:
    """One XLine's events decoded: metadata id, times, and the group of each event (with its stats)."""

    line: Any
    group: Array  # per event: index into keys
    keys: list[tuple[str, Stats]]  # per group: (name, metadata stats + event stats)
    start_ns: Array
    end_ns: Array
    dur_ps: Array


def _decode_line(line: Any, meta: dict[int, tuple[str, Stats]], stat_names: dict[int, str]) -> _Line:
    events = line.events
    n = len(events)
    lengths = np.fromiter(map(len, events), dtype=np.int64, count=n)
    data = b"".join(events)
    ends = np.cumsum(lengths)
    fields = protowire.fields(protowire.padded(data), ends - lengths, ends)
    metadata_id = fields.scalar(1, n)
    offset_ps = fields.scalar(2, n)
    dur_ps = np.maximum(fields.scalar(3, n), 0)
    # Raw bytes of each event's stats (first stat's tag to the last stat's end) identify them exactly.
    stats = fields.select(4)
    lo = np.zeros(n, dtype=np.int64)
    hi = np.zeros(n, dtype=np.int64)
    if len(stats.owner):
        owners, first = np.unique(stats.owner, return_index=True)
        last = len(stats.owner) - 1 - np.unique(stats.owner[::-1], return_index=True)[1]
        lo[owners] = stats.at[first]
        hi[owners] = stats.end[last]
    index: dict[tuple[int, bytes], int] = {}
    codes = [
        index.setdefault((m, data[a:b]), len(index))
        for m, a, b in zip(metadata_id.tolist(), lo.tolist(), hi.tolist(), strict=True)
    ]
    keys = []
    for mid, raw in index:
        name, md_stats = meta.get(mid, ("", []))
        own = _stats(xplane_proto.XEvent.FromString(raw).stats, stat_names) if raw else []
        keys.append((name, md_stats + own))
    base_ns = int(line.timestamp_ns)
    return _Line(
        line=line,
        group=np.array(codes, dtype=np.int64),
        keys=keys,
        start_ns=base_ns + offset_ps // 1000,
        end_ns=base_ns + (offset_ps + dur_ps) // 1000,
        dur_ps=dur_ps,
    )


def _plane_rows(plane: Any, acc: _Columns) -> None:
    device = device_of(plane.name)
    on_device = plane.name.startswith("/device:")
    gpu = on_device and not plane.name.startswith("/device:TPU")
    stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
    meta: dict[int, tuple[str, Stats]] = {
        k: (m.display_name or m.name, _stats(m.stats, stat_names)) for k, m in plane.event_metadata.items()
    }
    lines = [_decode_line(line, meta, stat_names) for line in plane.lines]
    modules = _by_stat(lines, "XLA Modules", "program_id", "")
    step_of_group = _by_stat(lines, "Steps", "group_id", "step:") if on_device else {}
    producers: dict[tuple[str | None, str | None], int] = {}
    consumers: list[tuple[Array, int, tuple[str | None, str | None]]] = []
    for ln in lines:
        line = ln.line
        category = "device" if gpu else line.name if on_device else "host"
        prefix = {"Steps": "step:", "XLA Modules": "HLO Module:"}.get(line.name, "") if on_device else ""
        xla_op = on_device and line.name == "XLA Ops"
        first_group = len(acc.groups["device"])
        group_step = []
        for name, stats in ln.keys:
            d = dict(stats)
            if not on_device and "_r" in d and "step_num" in d:
                stats = [*stats, ("step_name", f"{name} {d['step_num']}")]
            row = _stat_row(stats, xla_op, on_device, modules)
            row.update(
                device=device,
                stream_id=(line.id & _U32) if on_device else None,
                thread_id=None if on_device else line.id & _U32,
                thread_name=None if on_device else (line.name or line.display_name),
                kernel_name=prefix + name,
                category=category,
            )
            for c, v in row.items():
                acc.groups[c].append(v)
            group_step.append(acc.step_code(step_of_group.get(d.get("group_id"))) if xla_op else -1)
        if on_device:
            step = np.array(group_step, dtype=np.int64)[ln.group] if len(ln.group) else ln.group
        else:
            step = _host_steps(ln, acc)
            for i in _flow_events(ln):
                d = dict(ln.keys[ln.group[i]][1])
                if step[i] >= 0 and "_p" in d:
                    producers[(d.get("_pt"), d["_p"])] = int(step[i])
                if step[i] < 0 and "_c" in d:
                    consumers.append((step, i, (d.get("_ct"), d["_c"])))
        acc.parts["group"].append(ln.group + first_group)
        acc.parts["start_ns"].append(ln.start_ns)
        acc.parts["end_ns"].append(ln.end_ns)
        acc.parts["self"].append(ln.dur_ps // 1000)
        acc.parts["step"].append(step)
    for step, i, key in consumers:  # flow consumers (thread-pool regions) join their producer's step
        step[i] = producers.get(key, -1)


def _by_stat(lines: list[_Line], line_name: str, stat: str, prefix: str) -> dict[str | None, str]:
    """Stat value -> event name over the events of the lines called ``line_name`` (the last event wins)."""
    out: dict[str | None, str] = {}
    for ln in lines:
        if ln.line.name == line_name:
            for code in ln.group.tolist():
                name, stats = ln.keys[code]
                out[dict(stats).get(stat)] = prefix + name
    return out


def _flow_events(ln: _Line) -> list[int]:
    """Events whose stats carry a flow producer or consumer id (``_p``/``_c``), in order."""
    flows = [i for i, (_, stats) in enumerate(ln.keys) if any(k in ("_p", "_c") for k, _ in stats)]
    return np.flatnonzero(np.isin(ln.group, flows)).tolist() if flows else []


def _host_steps(ln: _Line, acc: _Columns) -> Array:
    """Step code of each host event: the host step annotation (``_r`` root with a ``step_num``) containing it."""
    is_root = [("_r" in (d := dict(stats)) and "step_num" in d) for _, stats in ln.keys]
    step = np.full(len(ln.group), -1, dtype=np.int64)
    if not any(is_root):
        return step
    roots = []
    for i in np.flatnonzero(np.asarray(is_root)[ln.group]).tolist():
        name, stats = ln.keys[ln.group[i]]
        start = int(ln.start_ns[i])
        roots.append((start, start + int(ln.dur_ps[i]) // 1000, f"{name} {dict(stats)['step_num']}"))
    roots.sort()
    root_start = np.array([r[0] for r in roots], dtype=np.int64)
    root_end = np.array([r[1] for r in roots], dtype=np.int64)
    code = np.array([acc.step_code(r[2]) for r in roots], dtype=np.int64)
    at = np.searchsorted(root_start, ln.start_ns, side="right") - 1
    safe = np.maximum(at, 0)
    inside = (at >= 0) & (ln.end_ns <= root_end[safe])
    step[inside] = code[safe[inside]]
    for i in np.flatnonzero((at > 0) & ~inside).tolist():  # nested or overlapping roots: walk back exactly
        found = _containing(roots, int(ln.start_ns[i]), int(ln.end_ns[i]))
        step[i] = acc.step_code(found)
    return step


def _containing(roots: list[tuple[int, int, str]], start: int, end: int) -> str | None:
    i = bisect.bisect_right(roots, (start, 2**63, "")) - 1
    while i >= 0:
        r_start, r_end, step = roots[i]
        if r_start <= start and end <= r_end:
            return step
        if r_end < start and i > 0 and roots[i - 1][1] < start:
            return None
        i -= 1
    return None


def _stat_row(stats: Stats, xla_op: bool, on_device: bool, modules: dict[str | None, str]) -> dict[str, Any]:
    d = dict(stats)
    kept = [(k, v) for k, v in stats if not (on_device and k in _DEVICE_COLUMN_STATS)]
    return {
        "correlation_id": _int(d.get("correlation_id")) if on_device else None,
        "kernel_details": d.get("kernel_details") if on_device else None,
        "tf_op_name": d.get("tf_op") if xla_op else None,
        "tf_op_type": "" if xla_op else None,
        "hlo_op": "" if xla_op else None,
        "hlo_module": modules.get(d.get("program_id")) if xla_op else None,
        "flops": _float(d.get("flops")) if xla_op else None,
        "memory_accessed": _float(d.get("bytes_accessed")) if xla_op else None,
        "trace_args": ",".join(f"{k}={v}" for k, v in kept) if kept else None,
    }


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
