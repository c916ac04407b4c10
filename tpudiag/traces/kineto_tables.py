"""A ``KinetoTrace`` analysed into the trace_events and steps tables: nesting, self time, modules, steps,
kernel launches, tpudiag's own work.

GPU kernels are linked to the CPU op that launched them: a kernel shares its ``correlation`` id with the
``cuda_runtime``/``cuda_driver`` launch call (``cudaLaunchKernel``, ``cuLaunchKernel``, ``hipLaunchKernel``...), and
the launching op is the innermost ``cpu_op`` around that call.  The kernel row then carries that op's name
(``framework_op``), event id (``launch_id``), module, phase and step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tpudiag.analysis.step_summary import StepSpan
from tpudiag.analysis.steps import detect_steps, step_array
from tpudiag.analysis.tree import attribute_modules, decode, encode, levels_by_depth, nest_arrays
from tpudiag.model import Step, TraceEvent, arrow_schema
from tpudiag.traces.kineto_columns import KinetoTrace

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_OP_CATEGORY = "cpu_op"


@dataclass(frozen=True)
class TraceTables:
    events: pa.Table
    steps: list[StepSpan]


def to_tables(
    trace: KinetoTrace,
    run_id: str,
    rank: int = 0,
    first_event_id: int = 0,
    first_step: int = 0,
    module_sources: dict[str, str] | None = None,
    root_inputs: Sequence[str | None] = (),
    source: str = "kineto",
    whole_fallback: bool = True,
) -> TraceTables:
    """Analyse one trace (nesting, self time, modules, steps, kernel launches) and build its trace_events table.

    Columnar throughout: strings are handled once per distinct value through dictionary codes."""
    cols = trace.columns
    n = len(trace)
    start = np.asarray(cols.column("start_ns").to_numpy(), dtype=np.int64)
    dur = np.asarray(cols.column("dur_ns").to_numpy(), dtype=np.int64)
    proc_codes, procs = encode(cols.column("process"))
    tid_codes, tids = encode(cols.column("thread"))
    thread_key = proc_codes * max(len(tids), 1) + tid_codes
    parent, depth, self_ns = nest_arrays(thread_key, start, dur)
    levels = levels_by_depth(depth)  # events grouped by depth, shared by every top-down pass below
    names = cols.column("name")
    attr = attribute_modules(
        names, cols.column("process"), start, cols.column("seq_nr"), parent, module_sources, levels=levels
    )
    steps = detect_steps(names, start, dur, parent, root_inputs, whole_fallback=whole_fallback, levels=levels)
    if first_step and not any(s.kind == "profiler_step" for s in steps):
        steps = [dataclasses.replace(s, step=s.step + first_step) for s in steps]
    cat_codes, cats = encode(cols.column("category"))
    on_device = _in(cat_codes, cats, DEVICE_CATEGORIES)
    launcher = _launching_ops(cat_codes, cats, cols.column("correlation"), parent, on_device, levels)
    linked = launcher >= 0
    # a device event takes the module, phase and step of the op that launched it
    inherit = pa.array(np.where(linked, launcher, np.arange(n)))
    name_codes, distinct_names = encode(names)
    framework_op = decode(np.where(linked, name_codes[np.maximum(launcher, 0)], -1), distinct_names)
    launch_id = np.where(linked, launcher + first_event_id, -1)
    proc_label = [trace.process_names.get(p, p) for p in procs]
    pair_codes, pair_first = np.unique(thread_key, return_index=True)
    thread_label = [
        trace.thread_names.get((procs[proc_codes[i]], tids[tid_codes[i]]), tids[tid_codes[i]])
        for i in pair_first.tolist()
    ]
    columns: dict[str, Any] = {
        "run_id": pa.repeat(run_id, n),
        "event_id": np.arange(first_event_id, first_event_id + n, dtype=np.int64),
        "source": pa.repeat(source, n),
        "process": decode(proc_codes, proc_label),
        "thread": decode(np.searchsorted(pair_codes, thread_key), thread_label),
        "name": names,
        "category": _mark_tool_overhead(cols.column("category"), name_codes, distinct_names, parent, levels),
        "start_ns": start,
        "dur_ns": dur,
        "self_ns": self_ns,
        "depth": depth,
        "parent_id": pa.array(parent + first_event_id, mask=parent < 0),
        "rank": np.full(n, rank, dtype=np.int64),
        "step": step_array(start, steps).take(inherit),
        "module": attr.module.take(inherit),
        "phase": attr.phase.take(inherit),
        "source_loc": attr.source_loc,
        "shapes": cols.column("shapes"),
        "dtypes": cols.column("dtypes"),
        "seq_nr": cols.column("seq_nr"),
        "external_id": cols.column("external_id"),
        "correlation": cols.column("correlation"),
        "on_device": on_device,
        "flops": pa.nulls(n, pa.float64()),
        "bytes_accessed": pa.nulls(n, pa.float64()),
        "framework_op": framework_op,
        "hlo_category": pa.nulls(n, pa.string()),
        "launch_id": pa.array(launch_id, mask=launch_id < 0),
        "args": cols.column("args"),
    }
    # string columns may stay dictionary-encoded (the spool casts, the store ingests them as they are)
    table = pa.table({f.name: _typed(columns[f.name], f.type) for f in arrow_schema(TraceEvent)})
    return TraceTables(events=table, steps=steps)


def _typed(value: Any, typ: pa.DataType) -> pa.Array | pa.ChunkedArray:
    if isinstance(value, pa.Array | pa.ChunkedArray):
        keep = value.type == typ or (pa.types.is_dictionary(value.type) and value.type.value_type == typ)
        return value if keep else value.cast(typ)
    return pa.array(value, typ)


def _in(codes: np.ndarray[Any, Any], distinct: list[str], wanted: frozenset[str]) -> np.ndarray[Any, Any]:
    hit = np.fromiter((v in wanted for v in distinct), dtype=bool, count=len(distinct))
    return hit[codes] if len(codes) else np.zeros(0, dtype=bool)


def _launching_ops(
    cat_codes: np.ndarray[Any, Any],
    cats: list[str],
    correlation: pa.ChunkedArray,
    parent: np.ndarray[Any, Any],
    on_device: np.ndarray[Any, Any],
    levels: list[np.ndarray[Any, Any]],
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """For each device event, the index of the ``cpu_op`` that launched it (-1 when unknown)."""
    n = len(cat_codes)
    out = np.full(n, -1, dtype=np.int64)
    corr = np.asarray(pc.fill_null(correlation, -1).to_numpy(), dtype=np.int64)
    launch = _in(cat_codes, cats, LAUNCH_CATEGORIES) & (corr >= 0)
    device = on_device & (corr >= 0)
    if not launch.any() or not device.any():
        return out
    # innermost cpu_op at or above every event, filled from the roots down
    op_above = np.where(_in(cat_codes, cats, frozenset({HOST_OP_CATEGORY})), np.arange(n), -1)
    for level in levels[1:]:
        own = op_above[level] >= 0
        inherit = level[~own]
        op_above[inherit] = op_above[parent[inherit]]
    launches = np.flatnonzero(launch)
    order = np.argsort(corr[launches], kind="stable")
    keys = corr[launches][order]
    targets = np.flatnonzero(device)
    k = np.searchsorted(keys, corr[targets])
    found = (k < len(keys)) & (keys[np.minimum(k, len(keys) - 1)] == corr[targets])
    runtime = launches[order][np.minimum(k, len(keys) - 1)]
    out[targets[found]] = op_above[runtime[found]]
    return out


def steps_table(steps: Sequence[StepSpan], run_id: str, rank: int = 0) -> pa.Table:
    cols: dict[str, Any] = {
        "run_id": [run_id] * len(steps),
        "step": [s.step for s in steps],
        "start_ns": [s.start_ns for s in steps],
        "dur_ns": [s.dur_ns for s in steps],
        "kind": [s.kind for s in steps],
        "input_shapes": [s.input_shapes for s in steps],
        "rank": [rank] * len(steps),
    }
    return pa.table(cols, schema=arrow_schema(Step))


TOOL_RANGE_PREFIX = "tpudiag::"
TOOL_CATEGORY = "tpudiag_overhead"
DISPATCH_WRAPPER = "PythonDispatchMode"
DISPATCH_CATEGORY = "python_dispatch"


def _mark_tool_overhead(
    category: pa.Array, name_codes: np.ndarray, names: list[str], parent: np.ndarray, levels: list[np.ndarray]
) -> pa.Array:
    """Events inside a ``tpudiag::`` range (the numerics checker's own work) get category ``tpudiag_overhead``.

    They stay in the trace, so the time tpudiag spent is visible, but they are never ranked as the script's ops.
    Names are tested once per distinct value (``names``; ``name_codes`` index it).
    """
    mark = _in_names(name_codes, names, lambda v: v.startswith(TOOL_RANGE_PREFIX))
    # A Python dispatch mode's own wrapper event: its self time is the mode's Python work, not an op of the script
    # (the op it dispatched is its child and keeps its category).
    wrapper = _in_names(name_codes, names, lambda v: v == DISPATCH_WRAPPER)
    if not mark.any() and not wrapper.any():
        return category
    for at in levels[1:]:
        mark[at] |= mark[parent[at]]
    # Under a dispatch mode an op is recorded twice: the outer call, then the mode's re-dispatch inside the wrapper.
    # The inner one holds the real work, so the outer one is dispatch bookkeeping too (an op then counts once).
    outer = parent[np.flatnonzero(wrapper)]
    wrapper[outer[outer >= 0]] = True
    if pa.types.is_dictionary(category.type):
        category = category.cast(pa.string())
    category = pc.if_else(pa.array(wrapper), pa.scalar(DISPATCH_CATEGORY), category)
    return pc.if_else(pa.array(mark), pa.scalar(TOOL_CATEGORY), category)


def _in_names(codes: np.ndarray, names: list[str], test: Callable[[str], bool]) -> np.ndarray:
    hit = np.fromiter(map(test, names), dtype=bool, count=len(names))
    return hit[codes] if len(codes) else np.zeros(0, dtype=bool)
