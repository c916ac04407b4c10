"""Event-tree analysis: nesting, self time, module and phase attribution.

Pure functions over plain columns (sequences or numpy arrays).  Self time is computed from the nesting of complete
events on each thread (torch's own "Self CPU" from ``key_averages`` can go negative with stacks on).

The work is vectorised with numpy so a million-event trace is analysed in about a second: on a thread whose events
nest properly (the normal case) an event's depth is the number of earlier events minus those that ended before it
started, and its parent is the last earlier event one level up.  A thread with partial overlaps or zero-length
events, where that shortcut does not hold, goes through the exact stack walk instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

MODULE_PREFIX = "module::"
BACKWARD_PREFIX = "autograd::engine::evaluate_function: "

IntArray = np.ndarray[Any, np.dtype[np.int64]]


@dataclass(frozen=True)
class Nesting:
    parent: list[int]  # -1 for roots
    depth: list[int]
    self_ns: list[int]


def thread_codes(threads: Sequence[Any]) -> IntArray:
    """Small integer codes for hashable thread keys (e.g. (process, thread) tuples)."""
    seen: dict[Any, int] = {}
    return np.fromiter((seen.setdefault(t, len(seen)) for t in threads), dtype=np.int64, count=len(threads))


def nest(threads: Sequence[Any], start_ns: Sequence[int], dur_ns: Sequence[int]) -> Nesting:
    """Parent, depth and self time of each event from containment on its (process, thread).

    An event that starts inside another but ends after it (partial overlap, e.g. async device work) is not its
    child.  Equal intervals nest in input order.
    """
    parent, depth, self_ns = nest_arrays(
        thread_codes(threads), np.asarray(start_ns, dtype=np.int64), np.asarray(dur_ns, dtype=np.int64)
    )
    return Nesting(parent=parent.tolist(), depth=depth.tolist(), self_ns=self_ns.tolist())


def nest_arrays(codes: IntArray, start: IntArray, dur: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """``nest`` over numpy columns: (parent, depth, self_ns) arrays; ``codes`` identifies each event's thread."""
    n = len(start)
    parent = np.full(n, -1, dtype=np.int64)
    depth = np.zeros(n, dtype=np.int64)
    if n == 0:
        return parent, depth, np.zeros(0, dtype=np.int64)
    idx = np.arange(n, dtype=np.int64)
    order = np.lexsort((idx, -dur, start, codes))
    sorted_codes = codes[order]
    bounds = np.flatnonzero(np.diff(sorted_codes)) + 1
    for seg in np.split(order, bounds):
        p, d = _nest_thread(start[seg], dur[seg])
        parent[seg] = np.where(p >= 0, seg[np.maximum(p, 0)], -1)
        depth[seg] = d
    child = np.bincount(parent[parent >= 0], weights=dur[parent >= 0], minlength=n).astype(np.int64)
    self_ns = np.maximum(dur - child, 0)
    return parent, depth, self_ns


def _nest_thread(s: IntArray, d: IntArray) -> tuple[IntArray, IntArray]:
    """Parent (index within the segment) and depth of one thread's events, already in nesting order."""
    m = len(s)
    e = s + d
    if m > 1 and d.min() > 0:
        pos = np.arange(m, dtype=np.int64)
        depth = pos - np.searchsorted(np.sort(e), s, side="right")
        if depth.min() >= 0:
            keys = depth * m + pos
            ranked = np.sort(keys)
            k = np.searchsorted(ranked, (depth - 1) * m + pos) - 1
            parent = np.where(depth > 0, ranked[np.maximum(k, 0)] % m, -1)
            inner = depth > 0
            ok = (
                np.all(depth[parent[inner]] == depth[inner] - 1)
                and np.all(e[inner] <= e[parent[inner]])
                and np.all(s[parent[inner]] <= s[inner])
                and np.all(np.maximum.accumulate(e)[:-1][depth[1:] == 0] <= s[1:][depth[1:] == 0])
            )
            if ok:
                return parent, depth
    return _nest_thread_loop(s, d)


def _nest_thread_loop(s: IntArray, d: IntArray) -> tuple[IntArray, IntArray]:
    """The exact stack walk (partial overlaps are not children; zero-length events at an end stay inside)."""
    starts, durs = s.tolist(), d.tolist()
    m = len(starts)
    parent = [-1] * m
    depth = [0] * m
    stack: list[int] = []
    for i in range(m):
        si, ei = starts[i], starts[i] + durs[i]
        while stack and starts[stack[-1]] + durs[stack[-1]] <= si and durs[i] > 0:
            stack.pop()
        while stack and starts[stack[-1]] + durs[stack[-1]] < ei:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
            depth[i] = depth[stack[-1]] + 1
        stack.append(i)
    return np.asarray(parent, dtype=np.int64), np.asarray(depth, dtype=np.int64)


@dataclass(frozen=True)
class Attribution:
    module: list[str | None]
    phase: list[str | None]
    source_loc: list[str | None]


def attribute_modules(
    names: Sequence[str],
    processes: Sequence[str],
    start_ns: Sequence[int],
    seq_nr: Sequence[int | None],
    parent: Sequence[int],
    module_sources: dict[str, str] | None = None,
) -> Attribution:
    """Module path, phase and source location of every event.

    Forward: the innermost enclosing ``module::<path>`` annotation.  Backward: the ops under
    ``autograd::engine::evaluate_function: XBackward0`` belong to the module of the forward op that created that
    autograd node, found through the autograd sequence number they share.
    """
    n = len(names)
    par = np.asarray(parent, dtype=np.int64)
    module = np.full(n, None, dtype=object)
    phase = np.full(n, None, dtype=object)
    own = np.zeros(n, dtype=bool)
    backward: list[int] = []
    for i, name in enumerate(names):
        if name.startswith(MODULE_PREFIX):
            module[i] = name[len(MODULE_PREFIX) :]
            phase[i] = "forward"
            own[i] = True
        elif name.startswith(BACKWARD_PREFIX):
            phase[i] = "backward"
            own[i] = True
            backward.append(i)
    levels = depth_levels(par)
    _propagate(levels, par, own, module, phase)
    if backward:
        first_forward: dict[tuple[str, int], tuple[int, str]] = {}
        starts = np.asarray(start_ns, dtype=np.int64)
        for i in np.flatnonzero((phase == "forward") & (module != None)).tolist():  # noqa: E711
            s = seq_nr[i]
            if s is None:
                continue
            key = (processes[i], s)
            known = first_forward.get(key)
            if known is None or (starts[i], i) < (starts[known[0]], known[0]):
                first_forward[key] = (i, module[i])
        for i in backward:
            s = seq_nr[i]
            found = first_forward.get((processes[i], s)) if s is not None else None
            module[i] = found[1] if found is not None else (module[par[i]] if par[i] >= 0 else None)
        _propagate(levels, par, own, module, phase)
    sources = module_sources or {}
    mods: list[str | None] = module.tolist()
    return Attribution(
        module=mods,
        phase=phase.tolist(),
        source_loc=[sources.get(m) if m is not None else None for m in mods],
    )


def depth_levels(parent: IntArray) -> list[IntArray]:
    """Event indices grouped by depth in the parent forest (roots first)."""
    frontier = np.flatnonzero(parent < 0)
    levels: list[IntArray] = []
    children_order = np.argsort(parent, kind="stable")
    sorted_parent = parent[children_order]
    while len(frontier):
        levels.append(frontier)
        lo = np.searchsorted(sorted_parent, frontier, side="left")
        hi = np.searchsorted(sorted_parent, frontier, side="right")
        counts = hi - lo
        if not counts.sum():
            break
        take = np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        frontier = children_order[take]
    return levels


def _propagate(
    levels: list[IntArray],
    parent: IntArray,
    own: np.ndarray[Any, Any],
    module: np.ndarray[Any, Any],
    phase: np.ndarray[Any, Any],
) -> None:
    """Events without their own module/phase take their parent's, level by level from the roots down."""
    for level in levels[1:]:
        inherit = level[~own[level]]
        module[inherit] = module[parent[inherit]]
        phase[inherit] = phase[parent[inherit]]
