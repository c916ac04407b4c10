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
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tpudiag.analysis import tree
from tpudiag.traces import protowire, xplane_proto

# Stats that become columns (not trace_args) on device lines, as in the Events DB.
_DEVICE_COLUMN_STATS = frozenset({"tf_op", "flops", "bytes_accessed", "correlation_id", "kernel_details"})
_U32 = 0xFFFFFFFF
_MODULE_WITH_ID = re.compile(r"^(.+)\((\d+)\)$")
Array = np.ndarray[Any, Any]
Stats = list[tuple[str, str | None]]

# Events DB columns fixed by an event's kind: its line and metadata, and its own stats where they change a
# column (not only trace_args), in the Events DB's order.
KIND_COLUMNS: dict[str, pa.DataType] = {
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
}


@dataclass(frozen=True)
class EventColumns:
    """Events of an XSpace in two levels of sharing.

    A *group* is a (line, metadata, own stats) triple: its trace_args are fixed.  A *kind* is what fixes every other
    column: usually (line, metadata), so a TPU op whose events differ only in a per-step ``group_id`` is one kind
    and one group per step.  Per event: its group, times and step.
    """

    kinds: dict[str, list[Any]]  # KIND_COLUMNS and the kind's trace_args, one entry per kind
    group_kind: Array  # int64 per group: index into kinds
    group_own: Array  # int64 per group: index into own_pairs (-1: the kind's trace_args are the group's)
    own_pairs: list[str]  # "key=value,..." of own stats that only add trace_args pairs
    group: Array  # int64 per event: index into groups
    start_ns: Array
    end_ns: Array
    self_time_ns: Array
    step_code: Array  # int64 per event: index into step_names, -1 for none
    step_names: list[str]

    @property
    def num_rows(self) -> int:
        return len(self.group)

    @property
    def trace_args(self) -> list[str | None]:
        """Per group: the kind's trace_args, then its own pairs."""
        kind_args: list[str | None] = self.kinds["trace_args"]
        out: list[str | None] = []
        for k, o in zip(self.group_kind.tolist(), self.group_own.tolist(), strict=True):
            base = kind_args[k]
            out.append(base if o < 0 else f"{base},{self.own_pairs[o]}" if base else self.own_pairs[o])
        return out

    @property
    def kind(self) -> Array:
        """Kind of each event."""
        return self.group_kind[self.group] if len(self.group) else self.group

    def group_table(self) -> pa.Table:
        kinds = pa.table({c: pa.array(self.kinds[c], typ) for c, typ in KIND_COLUMNS.items()})
        groups = kinds.take(pa.array(self.group_kind, pa.int64()))
        return groups.append_column("trace_args", pa.array(self.trace_args, pa.string()))

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
        names = [*KIND_COLUMNS, "trace_args"]
        order = [*names[:11], "self_time_ns", "step", *names[11:], "start_ns", "end_ns"]
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
    return read_planes(planes_of(data))


def planes_of(data: bytes) -> list[Any]:
    """The planes (``RawXSpace``, events still serialized) of a serialized XSpace that have lines."""
    return [plane for plane in xplane_proto.parse_raw_xspace(data).planes if plane.lines]


def read_planes(planes: list[Any]) -> EventColumns:
    """The events of these planes, in order (``concatenate`` joins the reads of consecutive runs of planes)."""
    acc = _Columns()
    for plane in planes:
        _plane_rows(plane, acc)
    return acc.finish()


def split_point(planes: list[Any]) -> int:
    """Where to cut the planes (1 .. len - 1) into two runs of about the same number of bytes."""
    sizes = np.cumsum([plane.ByteSize() for plane in planes])
    return min(max(int(np.argmin(np.abs(sizes - sizes[-1] / 2))) + 1, 1), len(planes) - 1)


def concatenate(head: EventColumns, tail: EventColumns) -> EventColumns:
    """The events of ``head`` then ``tail`` as if read in one pass: kinds, groups and own pairs renumbered, step
    names merged in first-seen order."""
    step_index = {name: i for i, name in enumerate(head.step_names)}
    step_map = np.array([step_index.setdefault(name, len(step_index)) for name in tail.step_names] + [-1], np.int64)
    return EventColumns(
        kinds={c: values + tail.kinds[c] for c, values in head.kinds.items()},
        group_kind=np.concatenate((head.group_kind, tail.group_kind + len(head.kinds["device"]))),
        group_own=np.concatenate(
            (head.group_own, np.where(tail.group_own < 0, -1, tail.group_own + len(head.own_pairs)))
        ),
        own_pairs=head.own_pairs + tail.own_pairs,
        group=np.concatenate((head.group, tail.group + len(head.group_kind))),
        start_ns=np.concatenate((head.start_ns, tail.start_ns)),
        end_ns=np.concatenate((head.end_ns, tail.end_ns)),
        self_time_ns=np.concatenate((head.self_time_ns, tail.self_time_ns)),
        step_code=np.concatenate((head.step_code, step_map[tail.step_code])),
        step_names=list(step_index),
    )


def events_table(data: bytes) -> pa.Table:
    """Serialized XSpace -> Events-DB-shaped Arrow table."""
    return read(data).table()


class _Columns:
    """Groups and per-event arrays of all planes, appended line by line."""

    def __init__(self) -> None:
        self.kinds: dict[str, list[Any]] = {c: [] for c in [*KIND_COLUMNS, "trace_args"]}
        self.group_kind: list[int] = []
        self.group_own: list[int] = []
        self.own_pairs: list[str] = []
        self.parts: dict[str, list[Array]] = {c: [] for c in ("group", "start_ns", "end_ns", "self", "step")}
        self.step_index: dict[str, int] = {}

    def add_kind(self, row: dict[str, Any], d: dict[str, str | None]) -> tuple[int, str | None, dict[str, str | None]]:
        """A new kind from a full row (KIND_COLUMNS and trace_args): (its index, trace_args, stats dict)."""
        for c, values in self.kinds.items():
            values.append(row[c])
        return len(self.kinds["device"]) - 1, row["trace_args"], d

    def step_code(self, step: str | None) -> int:
        return -1 if step is None else self.step_index.setdefault(step, len(self.step_index))

    def finish(self) -> EventColumns:
        def cat(name: str) -> Array:
            parts = self.parts[name]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        return EventColumns(
            kinds=self.kinds,
            group_kind=np.array(self.group_kind, dtype=np.int64),
            group_own=np.array(self.group_own, dtype=np.int64),
            own_pairs=self.own_pairs,
            group=cat("group"),
            start_ns=cat("start_ns"),
            end_ns=cat("end_ns"),
            self_time_ns=cat("self"),
            step_code=cat("step"),
            step_names=list(self.step_index),
        )


@dataclass
class _Line:
    """One XLine's events decoded: times, and the group of each event (its metadata id and own stat bytes)."""

    line: Any
    group: Array  # per event: index into keys
    keys: list[tuple[int, bytes]]  # per group: (metadata id, serialized own stats)
    mids: list[int]  # distinct metadata ids
    raws: list[bytes]  # distinct serialized own stats (raws[0] == b"": none)
    group_mid: Array  # per group: index into mids
    group_raw: Array  # per group: index into raws
    start_ns: Array
    end_ns: Array
    dur_ps: Array


def _decode_line(line: Any) -> _Line:
    events = list(line.events)  # each access to the protobuf container makes new bytes objects: once only
    n = len(events)
    lengths = np.fromiter(map(len, events), dtype=np.int64, count=n)
    buf = protowire.padded(b"".join(events))
    del events
    ends = np.cumsum(lengths)
    fields = protowire.fields(buf, ends - lengths, ends)
    metadata_id = fields.scalar(1, n)
    offset_ps = fields.scalar(2, n)
    dur_ps = np.maximum(fields.scalar(3, n), 0)
    # Raw bytes of each event's stats (first stat's tag to the last stat's end) identify them exactly.
    stats = fields.select(4)
    lo = np.zeros(n, dtype=np.int64)
    hi = np.zeros(n, dtype=np.int64)
    owners, first, last = protowire.first_and_last(stats.owner)
    lo[owners] = stats.at[first]
    hi[owners] = stats.end[last]
    own, raw = protowire.distinct_ranges(buf, lo, hi)
    mids, mid_code = protowire.dense_codes(metadata_id)
    combined, group = protowire.dense_codes(mid_code * len(raw) + own)
    base_ns = int(line.timestamp_ns)
    mid_list = mids.tolist()
    return _Line(
        line=line,
        group=group.ravel().astype(np.int64),
        keys=[(mid_list[k // len(raw)], raw[k % len(raw)]) for k in combined.tolist()],
        mids=mid_list,
        raws=raw,
        group_mid=combined // len(raw),
        group_raw=combined % len(raw),
        start_ns=base_ns + offset_ps // 1000,
        end_ns=base_ns + (offset_ps + dur_ps) // 1000,
        dur_ps=dur_ps,
    )


# Stats that change an event's columns (beyond trace_args) or make it a host step annotation.
_ROW_STATS = _DEVICE_COLUMN_STATS | {"program_id", "_r", "step_num"}


class _Plane:
    """A plane's metadata, with event stats decoded once per distinct serialized form."""

    def __init__(self, plane: Any) -> None:
        self.stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        self.meta: dict[int, tuple[str, Stats]] = {
            k: (m.display_name or m.name, _stats(m.stats, self.stat_names)) for k, m in plane.event_metadata.items()
        }
        self._own: dict[bytes, Stats] = {b"": []}
        self._pairs: dict[bytes, tuple[int, dict[str, str | None]] | None] = {}
        self._stats: dict[tuple[int, bytes], tuple[str, Stats]] = {}

    def own(self, raw: bytes) -> Stats:
        stats = self._own.get(raw)
        if stats is None:
            stats = self._own[raw] = _stats(xplane_proto.XEvent.FromString(raw).stats, self.stat_names)
        return stats

    def pairs(self, raw: bytes, acc: _Columns) -> tuple[int, dict[str, str | None]] | None:
        """Own stats that only add trace_args pairs: (their index in ``acc.own_pairs``, as a dict); else None."""
        if raw not in self._pairs:
            own = self.own(raw)
            if _ROW_STATS.isdisjoint(k for k, _ in own):
                acc.own_pairs.append(",".join(f"{k}={v}" for k, v in own))
                self._pairs[raw] = (len(acc.own_pairs) - 1, dict(own))
            else:
                self._pairs[raw] = None
        return self._pairs[raw]

    def stats(self, key: tuple[int, bytes]) -> tuple[str, Stats]:
        """(name, metadata stats + own stats) of a group (computed once: steps, flows and rows all ask)."""
        found = self._stats.get(key)
        if found is None:
            name, md_stats = self.meta.get(key[0], ("", []))
            found = self._stats[key] = (name, md_stats + self.own(key[1]) if key[1] else md_stats)
        return found


def _plane_rows(plane: Any, acc: _Columns) -> None:
    device = device_of(plane.name)
    on_device = plane.name.startswith("/device:")
    gpu = on_device and not plane.name.startswith("/device:TPU")
    xp = _Plane(plane)
    lines = [_decode_line(line) for line in plane.lines]
    modules = _module_names(xp, lines)
    step_of_group = _by_stat(xp, lines, "Steps", "group_id", "step:") if on_device else {}
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
        full_row = functools.partial(
            _full_row, xla_op=xla_op, on_device=on_device, modules=modules, columns=line_columns, prefix=prefix
        )
        group_kind, group_own, group_step = _line_groups(xp, ln, acc, full_row, step_of_group if xla_op else None)
        first_group = len(acc.group_kind)
        acc.group_kind.extend(group_kind.tolist())
        acc.group_own.extend(group_own.tolist())
        if on_device:
            step = group_step[ln.group] if len(ln.group) else ln.group
        else:
            step = _host_steps(xp, ln, acc)
            for i in _flow_events(xp, ln):
                d = dict(xp.stats(ln.keys[ln.group[i]])[1])
                if step[i] >= 0 and "_p" in d:
                    producers[(d.get("_pt"), d["_p"])] = int(step[i])
                if step[i] < 0 and "_c" in d:
                    consumers.append((step, i, (d.get("_ct"), d["_c"])))
        end_ns, self_ns = ln.end_ns, ln.dur_ps // 1000
        if on_device:
            end_ns, self_ns = _device_times(xp, ln, nested=xla_op)
        acc.parts["group"].append(ln.group + first_group)
        acc.parts["start_ns"].append(ln.start_ns)
        acc.parts["end_ns"].append(end_ns)
        acc.parts["self"].append(self_ns)
        acc.parts["step"].append(step)
    for step, i, key in consumers:  # flow consumers (thread-pool regions) join their producer's step
        step[i] = producers.get(key, -1)


def _device_times(xp: _Plane, ln: _Line, nested: bool) -> tuple[Array, Array]:
    """End and self time (ns) of a device line's events in the device's own clock, as XProf counts them.

    TPU op events carry ``device_offset_ps``/``device_duration_ps``: the op's span on the chip's clock.  The XEvent's
    own ``offset_ps``/``duration_ps`` are that span mapped onto the host clock, which stretches or shrinks ops (a
    ``copy-done`` of 194 s on the chip spans 299 s of host time in XProf's v6e-4 test trace).  XProf's op statistics
    use the device span, and an op's self time is its span less the spans of the ops nested in it on the same line
    (``nested``: an ``XLA Ops`` line).  The start stays host-aligned, so the timeline lines up with host threads.
    """
    if not any(ln.raws):  # no event has stats of its own (no device span): the host span is all there is
        return ln.end_ns, _host_self_ns(ln, nested)
    offset = np.full(len(ln.keys), -1, dtype=np.int64)
    duration = np.full(len(ln.keys), -1, dtype=np.int64)
    for i, (_, raw) in enumerate(ln.keys):
        if raw:
            own = dict(xp.own(raw))
            at, span = _int(own.get("device_offset_ps")), _int(own.get("device_duration_ps"))
            offset[i], duration[i] = (-1, -1) if at is None or span is None else (at, span)
    ev_offset, ev_dur = offset[ln.group], duration[ln.group]
    known = ev_dur >= 0
    dur_ps = np.where(known, ev_dur, ln.dur_ps)
    start_ps = np.where(known, ev_offset, (ln.start_ns - int(ln.line.timestamp_ns)) * 1000)
    end_ns = ln.start_ns + _ns(dur_ps)
    if not nested or len(dur_ps) == 0:
        return end_ns, _ns(dur_ps)
    _, _, self_ps = tree.nest_arrays(np.zeros(len(dur_ps), dtype=np.int64), start_ps, dur_ps)
    return end_ns, _ns(self_ps)


def _host_self_ns(ln: _Line, nested: bool) -> Array:
    if not nested or len(ln.dur_ps) == 0:
        return ln.dur_ps // 1000
    start_ps = (ln.start_ns - int(ln.line.timestamp_ns)) * 1000
    return tree.nest_arrays(np.zeros(len(ln.dur_ps), dtype=np.int64), start_ps, ln.dur_ps)[2] // 1000


def _ns(ps: Array) -> Array:
    """Picoseconds to the nearest nanosecond (not truncated: sums over many short ops stay unbiased)."""
    return (ps + 500) // 1000


def _line_groups(
    xp: _Plane,
    ln: _Line,
    acc: _Columns,
    full_row: Callable[[str, Stats], tuple[dict[str, Any], dict[str, str | None]]],
    step_of_group: dict[str | None, str] | None,
) -> tuple[Array, Array, Array]:
    """Kind, own-pairs index and step code of each group of a line (step codes only for ``XLA Ops`` lines).

    Each metadata id becomes a kind; a group whose own stats only add trace_args pairs (and whose metadata is no
    host step annotation) shares it, computed column-wise from per-metadata and per-own-stats values; any other
    group with own stats gets a kind of its own.
    """
    by_mid = [acc.add_kind(*full_row(*xp.stats((mid, b"")))) for mid in ln.mids]
    pairs = [xp.pairs(raw, acc) if raw else None for raw in ln.raws]
    mid_kind = np.array([kind for kind, _, _ in by_mid], dtype=np.int64)
    mid_root = np.array([("_r" in d and "step_num" in d) for _, _, d in by_mid], dtype=bool)
    raw_code = np.array([-1 if p is None else p[0] for p in pairs], dtype=np.int64)
    raw_shared = np.array([p is not None for p in pairs], dtype=bool)
    raw_shared[0] = True  # no own stats
    gm, gr = ln.group_mid, ln.group_raw
    shared = raw_shared[gr] & ((gr == 0) | ~mid_root[gm])
    group_kind = mid_kind[gm] if len(gm) else gm.copy()
    group_own = raw_code[gr] if len(gr) else gr.copy()
    group_step = np.full(len(gm), -1, dtype=np.int64)
    if step_of_group is not None:
        mid_step = np.array([acc.step_code(step_of_group.get(d.get("group_id"))) for _, _, d in by_mid], np.int64)
        raw_step = np.array(
            [
                -2 if p is None or "group_id" not in p[1] else acc.step_code(step_of_group.get(p[1]["group_id"]))
                for p in pairs
            ],
            dtype=np.int64,
        )
        group_step = np.where(raw_step[gr] == -2, mid_step[gm], raw_step[gr]) if len(gm) else group_step
    for i in np.flatnonzero(~shared).tolist():
        kind, _, d = acc.add_kind(*full_row(*xp.stats(ln.keys[i])))
        group_kind[i], group_own[i] = kind, -1
        if step_of_group is not None:
            group_step[i] = acc.step_code(step_of_group.get(d.get("group_id")))
    return group_kind, group_own, group_step


def _full_row(
    name: str,
    stats: Stats,
    xla_op: bool,
    on_device: bool,
    modules: dict[str | None, str],
    columns: dict[str, Any],
    prefix: str,
) -> tuple[dict[str, Any], dict[str, str | None]]:
    """A group's columns from all its stats (metadata's, then its own), and the stats as a dict."""
    d = dict(stats)
    if not on_device and "_r" in d and "step_num" in d:
        stats = [*stats, ("step_name", f"{name} {d['step_num']}")]
    return {**_stat_row(stats, xla_op, on_device, modules), **columns, "kernel_name": prefix + name}, d


def _by_stat(xp: _Plane, lines: list[_Line], line_name: str, stat: str, prefix: str) -> dict[str | None, str]:
    """Stat value -> event name over the events of the lines called ``line_name`` (the last event wins)."""
    out: dict[str | None, str] = {}
    for ln in lines:
        if ln.line.name == line_name:
            per_group = [(dict(stats).get(stat), prefix + name) for name, stats in map(xp.stats, ln.keys)]
            out.update(per_group[code] for code in ln.group.tolist())
    return out


def _module_names(xp: _Plane, lines: list[_Line]) -> dict[str | None, str]:
    """Program id (as text) -> HLO module name, from the ``XLA Modules`` line: its events' ``program_id`` stat,
    else their names, which TPU runtimes write as ``jit_f(12190760917235803885)``."""
    out = _by_stat(xp, lines, "XLA Modules", "program_id", "")
    for ln in lines:
        if ln.line.name == "XLA Modules":
            for name, _ in map(xp.stats, ln.keys):
                m = _MODULE_WITH_ID.match(name)
                if m and m.group(2) not in out:
                    out[m.group(2)] = m.group(1)
    return out


def _flow_events(xp: _Plane, ln: _Line) -> list[int]:
    """Events whose stats carry a flow producer or consumer id (``_p``/``_c``), in order."""
    flows = [i for i, key in enumerate(ln.keys) if any(k in ("_p", "_c") for k, _ in xp.stats(key)[1])]
    return np.flatnonzero(np.isin(ln.group, flows)).tolist() if flows else []


def _host_steps(xp: _Plane, ln: _Line, acc: _Columns) -> Array:
    """Step code of each host event: the host step annotation (``_r`` root with a ``step_num``) containing it."""
    keys = [xp.stats(key) for key in ln.keys]
    is_root = [("_r" in (d := dict(stats)) and "step_num" in d) for _, stats in keys]
    step = np.full(len(ln.group), -1, dtype=np.int64)
    if not any(is_root):
        return step
    roots = []
    for i in np.flatnonzero(np.asarray(is_root)[ln.group]).tolist():
        name, stats = keys[ln.group[i]]
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
    """An int64 column value; text that is no int64 (e.g. a uint64 id above 2**63) is left out."""
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and -(2**63) <= value < 2**63 else None


def _float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
