"""Step detection and the per-step summary (time to first result, steady state, outside steps).

Steps come from, in order of preference:
1. ``ProfilerStep#N`` annotations (the script drives its own profiler schedule);
2. optimizer steps (``Optimizer.step#...``): a step runs from the first root-module forward after the previous
   optimizer step to the end of its own optimizer step (gradient accumulation stays inside one step);
3. root-module forwards (inference loops): one step per top-level forward;
4. otherwise the whole trace is one step.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from tpudiag.analysis.step_summary import StepSpan
from tpudiag.analysis.tree import MODULE_PREFIX, Names, depth_levels, prefix_mask

PROFILER_STEP_PREFIX = "ProfilerStep#"
OPTIMIZER_STEP_PREFIX = "Optimizer.step#"


def root_forwards(
    names: Names,
    parent: Sequence[int] | np.ndarray[Any, Any],
    start_ns: Sequence[int] | np.ndarray[Any, Any],
    levels: list[np.ndarray[Any, Any]] | None = None,
) -> list[int]:
    """Indices of module annotations with no module annotation above them, in time order (``levels``: the
    tree's ``levels_by_depth``, when the caller has them)."""
    n = len(names)
    is_module = prefix_mask(names, MODULE_PREFIX)
    if not is_module.any():
        return []
    par = np.asarray(parent, dtype=np.int64)
    # under[i]: some ancestor of i is a module annotation; filled level by level from the roots down.
    under = np.zeros(n, dtype=bool)
    for level in (depth_levels(par) if levels is None else levels)[1:]:
        p = par[level]
        under[level] = is_module[p] | under[p]
    roots = np.flatnonzero(is_module & ~under)
    starts = np.asarray(start_ns, dtype=np.int64)[roots]
    ordered: list[int] = roots[np.argsort(starts, kind="stable")].tolist()
    return ordered


def detect_steps(
    names: Names,
    start_ns: Sequence[int] | np.ndarray[Any, Any],
    dur_ns: Sequence[int] | np.ndarray[Any, Any],
    parent: Sequence[int] | np.ndarray[Any, Any],
    root_inputs: Sequence[str | None] = (),
    whole_fallback: bool = True,
    levels: list[np.ndarray[Any, Any]] | None = None,
) -> list[StepSpan]:
    """Steps by the rules in the module docstring; ``whole_fallback=False`` returns [] instead of one whole step
    (a later chunk of a rotated trace with no step markers belongs to no step)."""
    n = len(names)
    if n == 0:
        return []
    roots = root_forwards(names, parent, start_ns, levels)
    name_of = _name_lookup(names)
    root_shapes = {idx: root_inputs[k] for k, idx in enumerate(roots) if k < len(root_inputs)}
    # The model is the root module that takes the most time; other roots (a loss module, a metric) run beside it
    # and must neither become steps nor blur the input shapes of a step.
    root_time: dict[str, int] = {}
    for idx in roots:
        root_time[name_of(idx)] = root_time.get(name_of(idx), 0) + int(dur_ns[idx])
    model_name = max(root_time, key=lambda k: root_time[k]) if root_time else None
    model_roots = [idx for idx in roots if name_of(idx) == model_name]

    def shapes_in(lo: int, hi: int) -> str | None:
        seen: list[str] = []
        for idx in model_roots:
            if lo <= start_ns[idx] < hi and root_shapes.get(idx) and root_shapes[idx] not in seen:
                seen.append(root_shapes[idx])  # type: ignore[arg-type]
        if not seen:
            return None
        return seen[0] if len(seen) == 1 else "[" + ",".join(seen) + "]"

    prof = sorted(np.flatnonzero(prefix_mask(names, PROFILER_STEP_PREFIX)).tolist(), key=lambda i: start_ns[i])
    if prof:
        spans: list[StepSpan] = []
        for i in prof:
            try:
                num = int(name_of(i)[len(PROFILER_STEP_PREFIX) :])
            except ValueError:
                num = len(spans)
            spans.append(
                StepSpan(
                    num,
                    start_ns[i],
                    dur_ns[i],
                    "profiler_step",
                    shapes_in(start_ns[i], start_ns[i] + dur_ns[i]),
                )
            )
        return spans

    opt = sorted(np.flatnonzero(prefix_mask(names, OPTIMIZER_STEP_PREFIX)).tolist(), key=lambda i: start_ns[i])
    if opt:
        root_starts = [start_ns[i] for i in roots]
        spans = []
        prev_end = int(np.min(start_ns))
        for k, i in enumerate(opt):
            end = start_ns[i] + dur_ns[i]
            j = bisect.bisect_left(root_starts, prev_end)
            begin = root_starts[j] if j < len(root_starts) and root_starts[j] < end else start_ns[i]
            spans.append(StepSpan(k, begin, end - begin, "optimizer", shapes_in(begin, end)))
            prev_end = end
        return spans

    if model_roots:
        return [StepSpan(k, start_ns[i], dur_ns[i], "forward", root_shapes.get(i)) for k, i in enumerate(model_roots)]

    if not whole_fallback:
        return []
    lo = int(np.min(start_ns))
    hi = int(np.max(np.asarray(start_ns, dtype=np.int64) + np.asarray(dur_ns, dtype=np.int64)))
    return [StepSpan(0, lo, hi - lo, "whole", None)]


def _name_lookup(names: Names) -> Callable[[int], str]:
    """The name at an index, for the few events looked at one by one (Arrow columns stay columnar)."""
    if isinstance(names, pa.Array | pa.ChunkedArray):
        return lambda i: str(names[i].as_py())
    return lambda i: names[i]


def assign_steps(start_ns: Sequence[int] | np.ndarray[Any, Any], steps: Sequence[StepSpan]) -> list[int | None]:
    """Step number of each event (the step whose interval holds its start), or None outside steps."""
    result: list[int | None] = step_array(start_ns, steps).to_pylist()
    return result


def step_array(start_ns: Sequence[int] | np.ndarray[Any, Any], steps: Sequence[StepSpan]) -> pa.Array:
    """``assign_steps`` as an Arrow int64 array (null outside steps), without per-event Python objects."""
    ordered = sorted(steps, key=lambda s: s.start_ns)
    t = np.asarray(start_ns, dtype=np.int64)
    if not ordered:
        return pa.nulls(len(t), pa.int64())
    starts = np.asarray([s.start_ns for s in ordered], dtype=np.int64)
    ends = starts + np.asarray([max(s.dur_ns, 1) for s in ordered], dtype=np.int64)
    numbers = np.asarray([s.step for s in ordered], dtype=np.int64)
    k = np.maximum(np.searchsorted(starts, t, side="right") - 1, 0)
    inside = (t >= starts[k]) & (t < ends[k])
    return pa.array(numbers[k], pa.int64(), mask=~inside)
