"""XPlane lines: one XLine's events decoded column-wise (``protowire``) and grouped by (metadata id, own stat
bytes), then what each line gives its events: kinds and own pairs per group, steps (device ``Steps`` line, host
step annotations, flows), device-clock end and self times, and the HLO module names of the ``XLA Modules`` line.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tpudiag.analysis import tree
from tpudiag.traces import protowire
from tpudiag.traces.xplane_columns import Array, Columns
from tpudiag.traces.xplane_stats import Plane, Stats, stat_int

_MODULE_WITH_ID = re.compile(r"^(.+)\((\d+)\)$")


@dataclass
class Line:
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


def decode_line(line: Any) -> Line:
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
    return Line(
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


def device_times(xp: Plane, ln: Line, nested: bool) -> tuple[Array, Array]:
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
            at, span = stat_int(own.get("device_offset_ps")), stat_int(own.get("device_duration_ps"))
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


def _host_self_ns(ln: Line, nested: bool) -> Array:
    if not nested or len(ln.dur_ps) == 0:
        return ln.dur_ps // 1000
    start_ps = (ln.start_ns - int(ln.line.timestamp_ns)) * 1000
    return tree.nest_arrays(np.zeros(len(ln.dur_ps), dtype=np.int64), start_ps, ln.dur_ps)[2] // 1000


def _ns(ps: Array) -> Array:
    """Picoseconds to the nearest nanosecond (not truncated: sums over many short ops stay unbiased)."""
    return (ps + 500) // 1000


def line_groups(
    xp: Plane,
    ln: Line,
    acc: Columns,
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


def by_stat(xp: Plane, lines: list[Line], line_name: str, stat: str, prefix: str) -> dict[str | None, str]:
    """Stat value -> event name over the events of the lines called ``line_name`` (the last event wins)."""
    out: dict[str | None, str] = {}
    for ln in lines:
        if ln.line.name == line_name:
            per_group = [(dict(stats).get(stat), prefix + name) for name, stats in map(xp.stats, ln.keys)]
            out.update(per_group[code] for code in ln.group.tolist())
    return out


def module_names(xp: Plane, lines: list[Line]) -> dict[str | None, str]:
    """Program id (as text) -> HLO module name, from the ``XLA Modules`` line: its events' ``program_id`` stat,
    else their names, which TPU runtimes write as ``jit_f(12190760917235803885)``."""
    out = by_stat(xp, lines, "XLA Modules", "program_id", "")
    for ln in lines:
        if ln.line.name == "XLA Modules":
            for name, _ in map(xp.stats, ln.keys):
                m = _MODULE_WITH_ID.match(name)
                if m and m.group(2) not in out:
                    out[m.group(2)] = m.group(1)
    return out


def flow_events(xp: Plane, ln: Line) -> list[int]:
    """Events whose stats carry a flow producer or consumer id (``_p``/``_c``), in order."""
    flows = [i for i, key in enumerate(ln.keys) if any(k in ("_p", "_c") for k, _ in xp.stats(key)[1])]
    return np.flatnonzero(np.isin(ln.group, flows)).tolist() if flows else []


def host_steps(xp: Plane, ln: Line, acc: Columns) -> Array:
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
