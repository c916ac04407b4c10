"""Memory within one trace window, from the profiler's allocator events: live bytes over time, what was live at the
peak by module path and op, the largest allocations with their shapes, each step's peak, and what was live when
an out-of-memory op started.

Attribution: an allocator event belongs to the events that enclose it in time on its own thread (the trace's
nesting).  Its *op* is the outermost ``cpu_op`` of that chain (the op the Python code called: ``aten::linear``, not
the ``aten::empty`` inside it, or an autograd node in backward) with that op's input shapes; its *module* is the
module path the trace analysis gave the innermost event.  Pure functions over arrays: no torch, no I/O.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from tpudiag.analysis.step_summary import StepSpan
from tpudiag.analysis.steps import assign_steps
from tpudiag.model import MemoryBlock, MemoryPoint, MemoryStep

METHOD = "profiler"
TIMELINE_POINTS = 2000  # per device and window (the peak always kept)
TOP_ALLOCATIONS = 20
BEFORE_WINDOW = "(allocated before the window)"
_WHAT = {"profiler": "profiler memory events", "dispatch": "live tensor bytes counted at dispatch"}


@dataclass
class MemoryEvents:
    """Columns, in time order: ``ts_ns`` (epoch ns, as ``kineto.load`` computes it), ``addr``, ``nbytes``,
    ``total_allocated``, ``total_reserved`` (-1: not given), ``device`` codes into ``devices`` ("cpu", "cuda:0"),
    ``thread`` as (pid, tid) strings."""

    ts_ns: np.ndarray[Any, Any]
    addr: np.ndarray[Any, Any]
    nbytes: np.ndarray[Any, Any]
    total_allocated: np.ndarray[Any, Any]
    total_reserved: np.ndarray[Any, Any]
    device: np.ndarray[Any, Any]
    devices: list[str]
    threads: list[tuple[str, str]]

    def __len__(self) -> int:
        return len(self.ts_ns)


@dataclass
class Sites:
    """Per memory event: its module, op, op input shapes and step (None where no enclosing event says)."""

    module: list[str | None]
    op: list[str | None]
    shapes: list[str | None]
    step: list[int | None]


@dataclass
class _Ops:
    """The trace events of the window, as plain columns (index = event_id - first event_id)."""

    start: np.ndarray[Any, Any]
    end: np.ndarray[Any, Any]
    parent: np.ndarray[Any, Any]
    is_op: np.ndarray[Any, Any]
    name: list[str]
    module: list[str | None]
    shapes: list[str | None]
    step: list[int | None]
    thread: list[str]

    @classmethod
    def of(cls, events: pa.Table) -> _Ops:
        n = events.num_rows
        first = int(events.column("event_id")[0].as_py()) if n else 0
        start = np.asarray(events.column("start_ns").to_numpy(zero_copy_only=False), dtype=np.int64)
        dur = np.asarray(events.column("dur_ns").to_numpy(zero_copy_only=False), dtype=np.int64)
        parent = events.column("parent_id").to_pylist()
        category = events.column("category").to_pylist()
        return cls(
            start=start,
            end=start + dur,
            parent=np.array([-1 if p is None else int(p) - first for p in parent], dtype=np.int64),
            is_op=np.array([c == "cpu_op" for c in category], dtype=bool),
            name=[str(x) for x in events.column("name").to_pylist()],
            module=events.column("module").to_pylist(),
            shapes=events.column("shapes").to_pylist(),
            step=events.column("step").to_pylist(),
            thread=[str(x) for x in events.column("thread").to_pylist()],
        )

    def outermost_op(self, i: int) -> int:
        """The outermost cpu_op on the chain from ``i`` up (-1 if none)."""
        found = -1
        while i >= 0:
            if self.is_op[i]:
                found = i
            i = int(self.parent[i])
        return found


def attribute(mem: MemoryEvents, events: pa.Table, thread_names: dict[tuple[str, str], str]) -> Sites:
    """Module, op, shapes and step of every memory event."""
    n = len(mem)
    sites = Sites([None] * n, [None] * n, [None] * n, [None] * n)
    if n == 0 or events.num_rows == 0:
        return sites
    ops = _Ops.of(events)
    by_thread: dict[str, np.ndarray[Any, Any]] = {}
    for label in set(ops.thread):
        members = np.flatnonzero(np.array([t == label for t in ops.thread]))
        by_thread[label] = members[np.argsort(ops.start[members], kind="stable")]
    for k in range(n):
        pid, tid = mem.threads[k]
        found = by_thread.get(thread_names.get((pid, tid), tid))
        if found is None:
            continue
        idx = found
        t = int(mem.ts_ns[k])
        pos = int(np.searchsorted(ops.start[idx], t, side="right")) - 1
        j = int(idx[pos]) if pos >= 0 else -1
        while j >= 0 and not (ops.start[j] <= t <= ops.end[j]):
            j = int(ops.parent[j])
        if j < 0:
            continue
        top = ops.outermost_op(j)
        sites.module[k] = ops.module[j]
        sites.step[k] = ops.step[j]
        if top >= 0:
            sites.op[k] = ops.name[top]
            sites.shapes[k] = ops.shapes[top]
    return sites


def failing_op(events: pa.Table) -> dict[str, Any] | None:
    """The op an out-of-memory error came from: the outermost cpu_op of the last op to end (an exception ends every
    enclosing op range as it unwinds, so the op that raised and its callers end last)."""
    if events.num_rows == 0:
        return None
    ops = _Ops.of(events)
    cand = np.flatnonzero(ops.is_op)
    if cand.size == 0:
        return None
    last = int(cand[np.argmax(ops.end[cand])])
    top = ops.outermost_op(last)
    # The innermost op it raised from: among the ops inside ``top``, the last to end (the deepest on a tie).
    inside = cand[(ops.start[cand] >= ops.start[top]) & (ops.end[cand] <= ops.end[top]) & (cand != top)]
    depth = {int(i): _depth(ops, int(i)) for i in inside.tolist()}
    inner = max(depth, key=lambda i: (int(ops.end[i]), depth[i])) if depth else top
    return {
        "op": ops.name[top],
        "inner_op": ops.name[inner],
        "module": ops.module[inner] or ops.module[top],
        "shapes": ops.shapes[top],
        "start_ns": int(ops.start[top]),
        "step": ops.step[top],
    }


def _depth(ops: _Ops, i: int) -> int:
    d = 0
    while ops.parent[i] >= 0:
        i, d = int(ops.parent[i]), d + 1
    return d


def _live_at(mem: MemoryEvents, dev: int, upto: int) -> dict[int, tuple[int, int]]:
    """addr -> (bytes, event index) of the blocks allocated in the window and still live after event ``upto``."""
    live: dict[int, tuple[int, int]] = {}
    for k in range(upto + 1):
        if mem.device[k] != dev:
            continue
        b = int(mem.nbytes[k])
        if b > 0:
            live[int(mem.addr[k])] = (b, k)
        else:
            live.pop(int(mem.addr[k]), None)
    return live


def _group(
    live: dict[int, tuple[int, int]], sites: Sites, total: int | None
) -> list[tuple[str | None, str | None, str | None, int, int]]:
    """(module, op, shapes, bytes, count), largest first; bytes the window did not see allocated as one row."""
    groups: dict[tuple[str | None, str | None, str | None], list[int]] = defaultdict(lambda: [0, 0])
    for b, k in live.values():
        g = groups[(sites.module[k], sites.op[k], sites.shapes[k])]
        g[0] += b
        g[1] += 1
    rows = [(m, o, s, v[0], v[1]) for (m, o, s), v in groups.items()]
    seen = sum(v[0] for v in groups.values())
    if total is not None and total > seen:
        rows.append((None, BEFORE_WINDOW, None, total - seen, 0))
    rows.sort(key=lambda r: -r[3])
    return rows


def _downsample(values: np.ndarray[Any, Any], limit: int) -> np.ndarray[Any, Any]:
    """Indices keeping each bucket's min and max (and so the peak), at most ``limit`` of them."""
    n = len(values)
    if n <= limit:
        return np.arange(n)
    edges = np.linspace(0, n, limit // 2 + 1).astype(np.int64)
    keep: list[int] = []
    for lo, hi in itertools.pairwise(edges.tolist()):
        if hi > lo:
            seg = values[lo:hi]
            keep += [lo + int(np.argmin(seg)), lo + int(np.argmax(seg))]
    return np.unique(np.array(keep, dtype=np.int64))


@dataclass
class WindowMemory:
    points: list[MemoryPoint]
    blocks: list[MemoryBlock]
    steps: list[MemoryStep]


def analyse(
    mem: MemoryEvents,
    sites: Sites,
    run_id: str,
    window: int,
    steps: Sequence[StepSpan] = (),
    rank: int = 0,
    oom_start_ns: int | None = None,
    method: str = METHOD,
) -> WindowMemory:
    """The window's timeline, live blocks at its peak, largest allocations and per-step peaks (per device); with
    ``oom_start_ns``, the blocks live when the failing op started (kind "at_oom")."""
    out = WindowMemory([], [], [])
    if len(mem) == 0:
        return out
    step_of = assign_steps(mem.ts_ns, steps) if steps else [None] * len(mem)
    step_at = [sites.step[k] if sites.step[k] is not None else step_of[k] for k in range(len(mem))]
    for dev, name in enumerate(mem.devices):
        idx = np.flatnonzero(mem.device == dev)
        totals = mem.total_allocated[idx]
        known = totals >= 0
        for i in idx[_downsample(totals, TIMELINE_POINTS)].tolist():
            if mem.total_allocated[i] < 0:
                continue
            reserved = int(mem.total_reserved[i])
            out.points.append(
                MemoryPoint(
                    run_id, window, int(mem.ts_ns[i]), int(mem.total_allocated[i]), method,
                    reserved if reserved > 0 else None, name, step_at[i], rank,
                )
            )  # fmt: skip
        if known.any():
            peak = int(idx[int(np.argmax(np.where(known, totals, -1)))])
            total = int(mem.total_allocated[peak])
            for m, o, s, b, c in _group(_live_at(mem, dev, peak), sites, total):
                out.blocks.append(
                    MemoryBlock(run_id, window, "at_peak", b, method, c, name, m, o, s, step_at[peak],
                                int(mem.ts_ns[peak]), rank)
                )  # fmt: skip
        allocs = idx[mem.nbytes[idx] > 0]
        for k in allocs[np.argsort(-mem.nbytes[allocs], kind="stable")][:TOP_ALLOCATIONS].tolist():
            out.blocks.append(
                MemoryBlock(run_id, window, "top_alloc", int(mem.nbytes[k]), method, 1, name, sites.module[k],
                            sites.op[k], sites.shapes[k], step_at[k], int(mem.ts_ns[k]), rank)
            )  # fmt: skip
        if oom_start_ns is not None:
            before = idx[mem.ts_ns[idx] < oom_start_ns]
            if before.size:
                last = int(before[-1])
                total_then = int(mem.total_allocated[last]) if mem.total_allocated[last] >= 0 else None
                for m, o, s, b, c in _group(_live_at(mem, dev, last), sites, total_then):
                    out.blocks.append(
                        MemoryBlock(run_id, window, "at_oom", b, method, c, name, m, o, s, step_at[last],
                                    int(mem.ts_ns[last]), rank)
                    )  # fmt: skip
        out.steps += _step_peaks(mem, idx, step_at, run_id, name, rank, method)
    return out


def _step_peaks(
    mem: MemoryEvents,
    idx: np.ndarray[Any, Any],
    step_at: list[int | None],
    run_id: str,
    device: str,
    rank: int,
    method: str = METHOD,
) -> list[MemoryStep]:
    peaks: dict[int, list[int]] = {}  # step -> [peak, allocated after its last event, ts of that event]
    for k in idx.tolist():
        s, total = step_at[k], int(mem.total_allocated[k])
        if s is None or total < 0:
            continue
        cur = peaks.setdefault(s, [total, total, int(mem.ts_ns[k])])
        cur[0] = max(cur[0], total)
        cur[1], cur[2] = total, int(mem.ts_ns[k])
    sources = json.dumps(
        {"peak_bytes": f"{_WHAT[method]} (max live bytes in the step)",
         "allocated_bytes": f"{_WHAT[method]} (live bytes after the step's last event)"}
    )  # fmt: skip
    return [
        MemoryStep(run_id, s, method, ts, device, allocated_bytes=last, peak_bytes=peak, sources=sources,
                   rank=rank)
        for s, (peak, last, ts) in sorted(peaks.items())
    ]  # fmt: skip
