"""An XSpace (parsed in-process with the ``xplane_proto`` classes) as an events table shaped like xprof's Events DB.

xprof's Events DB turns an XSpace into one row per XEvent; tpudiag used to run it in a child process (its native
code crashes on some inputs and clashes with duckdb), which cost ~2 s of process start per import.  Here the same
columns are built directly from the protobuf (upb parsing: fast, and a bad file is a ``DecodeError``, never a
crash), resolving what the Events DB resolves: event names (with its ``step:``/``HLO Module:`` prefixes on device
lines), stats of the event and of its metadata (``tf_op``, ``flops``, ``bytes_accessed``, ``program_id`` -> HLO
module, ``correlation_id``, ``kernel_details``; the rest as ``trace_args`` ``key=value`` pairs), host threads
(line name, id truncated to 32 bits) and device streams (line id).  Times are exact integers (ns): the Events DB
goes through doubles and rounds epoch timestamps to ~256 ns.
"""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import pyarrow as pa

# Stats that become columns (not trace_args) on device lines, as in the Events DB.
_DEVICE_COLUMN_STATS = frozenset({"tf_op", "flops", "bytes_accessed", "correlation_id", "kernel_details"})
_U32 = 0xFFFFFFFF


def device_of(plane_name: str) -> str:
    """``/device:TPU:0`` -> ``TPU:0``; ``/host:CPU`` -> ``cpu:0``."""
    if plane_name.startswith("/device:"):
        return plane_name[len("/device:") :]
    if plane_name == "/host:CPU":
        return "cpu:0"
    return plane_name.lstrip("/")


def _stats(stats: Any, names: dict[int, str]) -> list[tuple[str, str | None]]:
    """(name, value as text) of each XStat; ``ref_value`` resolves to the referenced stat metadata's name."""
    out: list[tuple[str, str | None]] = []
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


def events_table(space: Any) -> pa.Table:
    """XSpace message -> Events-DB-shaped Arrow table (the columns ``xplane.to_tables`` reads)."""
    cols: dict[str, list[Any]] = {c: [] for c in _COLUMNS}
    for plane in space.planes:
        if not plane.lines:
            continue
        _plane_rows(plane, cols)
    n = len(cols["start_ns"])
    arrays = {c: pa.array(cols[c], typ) for c, typ in _COLUMNS.items() if c not in ("start_ns", "end_ns")}
    arrays["start_ns"] = pa.array(np.asarray(cols["start_ns"], dtype=np.int64))
    arrays["end_ns"] = pa.array(np.asarray(cols["end_ns"], dtype=np.int64))
    arrays["input_tensors"] = pa.nulls(n, pa.list_(pa.string()))
    arrays["output_tensors"] = pa.nulls(n, pa.list_(pa.string()))
    for c in ("hlo_fingerprint", "flow"):
        arrays[c] = pa.nulls(n, pa.uint64())
    arrays["source_line"] = pa.nulls(n, pa.string())
    return pa.table(arrays)


_COLUMNS: dict[str, pa.DataType] = {
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
    "start_ns": pa.int64(),
    "end_ns": pa.int64(),
    "self_time_ns": pa.int64(),
    "step": pa.string(),
    "category": pa.string(),
    "flops": pa.float64(),
    "memory_accessed": pa.float64(),
    "trace_args": pa.string(),
}


def _plane_rows(plane: Any, cols: dict[str, list[Any]]) -> None:
    device = device_of(plane.name)
    on_device = plane.name.startswith("/device:")
    gpu = on_device and not plane.name.startswith("/device:TPU")
    stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
    meta: dict[int, tuple[str, list[tuple[str, str | None]]]] = {
        k: (m.display_name or m.name, _stats(m.stats, stat_names)) for k, m in plane.event_metadata.items()
    }
    modules = {
        dict(stats).get("program_id"): name
        for line in plane.lines
        if line.name == "XLA Modules"
        for name, stats in (_event_stats(e, meta, plane, stat_names) for e in line.events)
    }
    step_of_group = {
        dict(stats).get("group_id"): "step:" + name
        for line in plane.lines
        if on_device and line.name == "Steps"
        for name, stats in (_event_stats(e, meta, plane, stat_names) for e in line.events)
    }
    producers: dict[tuple[str | None, str | None], str] = {}
    consumers: list[tuple[int, tuple[str | None, str | None]]] = []
    for line in plane.lines:
        category = "device" if gpu else line.name if on_device else "host"
        prefix = {"Steps": "step:", "XLA Modules": "HLO Module:"}.get(line.name, "") if on_device else ""
        base_ns = int(line.timestamp_ns)
        stream = (line.id & _U32) if on_device else None
        thread_id = None if on_device else line.id & _U32
        thread_name = None if on_device else (line.name or line.display_name)
        events = [(ev, *_event_stats(ev, meta, plane, stat_names)) for ev in line.events]
        roots = _step_roots(events, base_ns)
        for ev, name, stats in events:
            offset_ps = int(ev.offset_ps)
            dur_ps = max(int(ev.duration_ps), 0)
            start_ns = base_ns + offset_ps // 1000
            end_ns = base_ns + (offset_ps + dur_ps) // 1000
            d = dict(stats)
            if on_device:
                step = step_of_group.get(d.get("group_id")) if line.name == "XLA Ops" else None
            else:
                step = _containing(roots, start_ns, end_ns)
                if "_r" in d and "step_num" in d:
                    stats = [*stats, ("step_name", f"{name} {d['step_num']}")]
                if step is not None and "_p" in d:
                    producers[(d.get("_pt"), d["_p"])] = step
                if step is None and "_c" in d:
                    consumers.append((len(cols["step"]), (d.get("_ct"), d["_c"])))
            cols["device"].append(device)
            cols["stream_id"].append(stream)
            cols["thread_id"].append(thread_id)
            cols["thread_name"].append(thread_name)
            cols["kernel_name"].append(prefix + name)
            cols["start_ns"].append(start_ns)
            cols["end_ns"].append(end_ns)
            cols["self_time_ns"].append(dur_ps // 1000)
            cols["category"].append(category)
            cols["step"].append(step)
            _stat_columns(cols, stats, on_device and line.name == "XLA Ops", on_device, modules)
    for row, key in consumers:  # flow consumers (thread-pool regions) join their producer's step
        cols["step"][row] = producers.get(key)


def _event_stats(
    ev: Any, meta: dict[int, tuple[str, list[tuple[str, str | None]]]], plane: Any, names: dict[int, str]
) -> tuple[str, list[tuple[str, str | None]]]:
    name, md_stats = meta.get(ev.metadata_id, ("", []))
    return name, md_stats + _stats(ev.stats, names)


def _step_roots(
    events: list[tuple[Any, str, list[tuple[str, str | None]]]], base_ns: int
) -> list[tuple[int, int, str]]:
    """Host step annotations (``_r`` root events with a ``step_num``): (start, end, "<name> <step_num>")."""
    roots = []
    for ev, name, stats in events:
        d = dict(stats)
        if "_r" in d and "step_num" in d:
            start = base_ns + int(ev.offset_ps) // 1000
            roots.append((start, start + max(int(ev.duration_ps), 0) // 1000, f"{name} {d['step_num']}"))
    return sorted(roots)


def _containing(roots: list[tuple[int, int, str]], start: int, end: int) -> str | None:
    if not roots:
        return None
    i = bisect.bisect_right(roots, (start, 2**63, "")) - 1
    while i >= 0:
        r_start, r_end, step = roots[i]
        if r_start <= start and end <= r_end:
            return step
        if r_end < start and i > 0 and roots[i - 1][1] < start:
            return None
        i -= 1
    return None


def _stat_columns(
    cols: dict[str, list[Any]],
    stats: list[tuple[str, str | None]],
    xla_op: bool,
    on_device: bool,
    modules: dict[str | None, str],
) -> None:
    d = dict(stats)
    cols["correlation_id"].append(_int(d.get("correlation_id")) if on_device else None)
    cols["kernel_details"].append(d.get("kernel_details") if on_device else None)
    cols["tf_op_name"].append(d.get("tf_op") if xla_op else None)
    cols["tf_op_type"].append("" if xla_op else None)
    cols["hlo_op"].append("" if xla_op else None)
    cols["hlo_module"].append(modules.get(d.get("program_id")) if xla_op else None)
    cols["flops"].append(_float(d.get("flops")) if xla_op else None)
    cols["memory_accessed"].append(_float(d.get("bytes_accessed")) if xla_op else None)
    kept = [(k, v) for k, v in stats if not (on_device and k in _DEVICE_COLUMN_STATS)]
    cols["trace_args"].append(",".join(f"{k}={v}" for k, v in kept) if kept else None)


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
