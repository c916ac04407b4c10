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

This module reads planes; ``xplane_lines`` decodes and groups a line's events, ``xplane_stats`` turns stats into
columns, ``xplane_columns`` holds the result.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa

from tpudiag.traces import xplane_proto
from tpudiag.traces.xplane_columns import Array, Columns, EventColumns
from tpudiag.traces.xplane_lines import (
    by_stat,
    decode_line,
    device_times,
    flow_events,
    host_steps,
    line_groups,
    module_names,
)
from tpudiag.traces.xplane_stats import Plane, full_row

_U32 = 0xFFFFFFFF


def device_of(plane_name: str) -> str:
    """``/device:TPU:0`` -> ``TPU:0``; ``/host:CPU`` -> ``cpu:0``."""
    if plane_name.startswith("/device:"):
        return plane_name[len("/device:") :]
    if plane_name == "/host:CPU":
        return "cpu:0"
    return plane_name.lstrip("/")


def read(data: bytes) -> EventColumns:
    """Serialized XSpace -> its events (``DecodeError`` when the bytes are not one)."""
    return read_planes(planes_of(data))


def planes_of(data: bytes) -> list[Any]:
    """The planes (``RawXSpace``, events still serialized) of a serialized XSpace that have lines."""
    return [plane for plane in xplane_proto.parse_raw_xspace(data).planes if plane.lines]


def read_planes(planes: list[Any]) -> EventColumns:
    """The events of these planes, in order (``concatenate`` joins the reads of consecutive runs of planes)."""
    acc = Columns()
    for plane in planes:
        _plane_rows(plane, acc)
    return acc.finish()


def split_point(planes: list[Any]) -> int:
    """Where to cut the planes (1 .. len - 1) into two runs of about the same number of bytes."""
    sizes = np.cumsum([plane.ByteSize() for plane in planes])
    return min(max(int(np.argmin(np.abs(sizes - sizes[-1] / 2))) + 1, 1), len(planes) - 1)


def events_table(data: bytes) -> pa.Table:
    """Serialized XSpace -> Events-DB-shaped Arrow table."""
    return read(data).table()


def _plane_rows(plane: Any, acc: Columns) -> None:
    device = device_of(plane.name)
    on_device = plane.name.startswith("/device:")
    gpu = on_device and not plane.name.startswith("/device:TPU")
    xp = Plane(plane)
    lines = [decode_line(line) for line in plane.lines]
    modules = module_names(xp, lines)
    step_of_group = by_stat(xp, lines, "Steps", "group_id", "step:") if on_device else {}
    producers: dict[tuple[str | None, str | None], int] = {}
    consumers: list[tuple[Array, int, tuple[str | None, str | None]]] = []
    for ln in lines:
        line = ln.line
        category = "device" if gpu else line.name if on_device else "host"
        prefix = {"Steps": "step:", "XLA Modules": "HLO Module:"}.get(line.name, "") if on_device else ""
        xla_op = on_device and line.name == "XLA Ops"
        line_columns = {
            "device": device,
            "stream_id": (line.id & _U32) if on_device else None,
            "thread_id": None if on_device else line.id & _U32,
            "thread_name": None if on_device else (line.name or line.display_name),
            "category": category,
        }
        row_of = functools.partial(
            full_row, xla_op=xla_op, on_device=on_device, modules=modules, columns=line_columns, prefix=prefix
        )
        group_kind, group_own, group_step = line_groups(xp, ln, acc, row_of, step_of_group if xla_op else None)
        first_group = len(acc.group_kind)
        acc.group_kind.extend(group_kind.tolist())
        acc.group_own.extend(group_own.tolist())
        if on_device:
            step = group_step[ln.group] if len(ln.group) else ln.group
        else:
            step = host_steps(xp, ln, acc)
            for i in flow_events(xp, ln):
                d = dict(xp.stats(ln.keys[ln.group[i]])[1])
                if step[i] >= 0 and "_p" in d:
                    producers[(d.get("_pt"), d["_p"])] = int(step[i])
                if step[i] < 0 and "_c" in d:
                    consumers.append((step, i, (d.get("_ct"), d["_c"])))
        end_ns, self_ns = ln.end_ns, ln.dur_ps // 1000
        if on_device:
            end_ns, self_ns = device_times(xp, ln, nested=xla_op)
        acc.parts["group"].append(ln.group + first_group)
        acc.parts["start_ns"].append(ln.start_ns)
        acc.parts["end_ns"].append(end_ns)
        acc.parts["self"].append(self_ns)
        acc.parts["step"].append(step)
    for step, i, key in consumers:  # flow consumers (thread-pool regions) join their producer's step
        step[i] = producers.get(key, -1)
