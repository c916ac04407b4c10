"""The window analysis on hand-built allocator events and trace events (tpudiag.analysis.memory_events): contract
(empty in, empty out; inputs untouched), attribution to the outermost op on the event's own thread, the live set
at the peak, per-step peaks, the downsampled timeline keeping the peak, and the failing op of an OOM."""

from __future__ import annotations

import copy

import numpy as np

from tests.factories import make_event
from tpudiag.analysis import memory_events as me
from tpudiag.analysis.memory_events import MemoryEvents
from tpudiag.analysis.step_summary import StepSpan
from tpudiag.model import TraceEvent, records_to_arrow

T0 = 1_000_000


def _mem(rows: list[tuple[int, int, int, int]], thread: tuple[str, str] = ("1", "1")) -> MemoryEvents:
    """rows: (ts_ns, addr, bytes, total after)."""
    n = len(rows)
    return MemoryEvents(
        ts_ns=np.array([r[0] for r in rows], dtype=np.int64),
        addr=np.array([r[1] for r in rows], dtype=np.int64),
        nbytes=np.array([r[2] for r in rows], dtype=np.int64),
        total_allocated=np.array([r[3] for r in rows], dtype=np.int64),
        total_reserved=np.full(n, -1, dtype=np.int64),
        device=np.zeros(n, dtype=np.int32),
        devices=["cpu"],
        threads=[thread] * n,
    )


def _events() -> object:
    """module range > aten::linear > aten::addmm (the allocation is inside addmm) on thread 1; aten::relu later."""
    rows = [
        make_event("r", 0, "module::fc", T0, 1000, category="user_annotation", module="fc", step=0),
        make_event("r", 1, "aten::linear", T0 + 100, 500, depth=1, parent_id=0, module="fc", shapes="[[4,8]]", step=0),
        make_event("r", 2, "aten::addmm", T0 + 150, 300, depth=2, parent_id=1, module="fc", shapes="[[8]]", step=0),
        make_event("r", 3, "aten::relu", T0 + 700, 100, depth=1, parent_id=0, module="fc", shapes="[[4,8]]", step=0),
        make_event("r", 4, "aten::mul", T0 + 2000, 100, module="head", shapes="[[4,4]]", step=1),
    ]
    return records_to_arrow(TraceEvent, rows)


def test_empty_in_empty_out() -> None:
    empty = _mem([])
    sites = me.attribute(empty, _events(), {})  # type: ignore[arg-type]
    out = me.analyse(empty, sites, "r", 0)
    assert (out.points, out.blocks, out.steps) == ([], [], [])
    assert me.failing_op(records_to_arrow(TraceEvent, [])) is None


def test_attribution_live_set_at_peak_and_step_peaks() -> None:
    mem = _mem(
        [  # totals count 10 kB allocated before the window
            (T0 + 200, 1, 4096, 14_096),  # inside addmm < linear: op aten::linear
            (T0 + 750, 2, 1024, 15_120),  # inside relu
            (T0 + 760, 1, -4096, 11_024),  # linear's block freed (inside relu too)
            (T0 + 2050, 3, 8192, 19_216),  # inside mul, step 1: the peak
            (T0 + 5000, 2, -1024, 18_192),  # outside every op
        ]
    )
    before = copy.deepcopy(mem)
    sites = me.attribute(mem, _events(), {})  # type: ignore[arg-type]
    assert sites.op == ["aten::linear", "aten::relu", "aten::relu", "aten::mul", None]
    assert sites.module == ["fc", "fc", "fc", "head", None]
    assert sites.shapes[0] == "[[4,8]]"  # the outermost op's input shapes
    steps = [StepSpan(0, T0, 1500, "optimizer", None), StepSpan(1, T0 + 1500, 4000, "optimizer", None)]
    out = me.analyse(mem, sites, "r", 3, steps)
    at_peak = [(b.module, b.op, b.bytes) for b in out.blocks if b.kind == "at_peak"]
    # the freed block is not live; what the window did not see allocated is one row
    assert at_peak == [(None, me.BEFORE_WINDOW, 10_000), ("head", "aten::mul", 8192), ("fc", "aten::relu", 1024)]
    assert all(b.window_id == 3 and b.method == "profiler" for b in out.blocks)
    top = [(b.op, b.bytes) for b in out.blocks if b.kind == "top_alloc"]
    assert top == [("aten::mul", 8192), ("aten::linear", 4096), ("aten::relu", 1024)]
    assert [(s.step, s.peak_bytes, s.allocated_bytes) for s in out.steps] == [(0, 15_120, 11_024), (1, 19_216, 18_192)]
    assert np.array_equal(mem.ts_ns, before.ts_ns) and mem.threads == before.threads  # input untouched


def test_other_threads_events_are_not_attributed_by_time_alone() -> None:
    mem = _mem([(T0 + 200, 1, 4096, 4096)], thread=("1", "99"))
    sites = me.attribute(mem, _events(), {})  # type: ignore[arg-type]
    assert sites.op == [None] and sites.module == [None]


def test_timeline_is_bounded_and_keeps_the_peak() -> None:
    n = 50_000
    totals = (np.sin(np.arange(n) / 300.0) * 1000 + 5000).astype(np.int64)
    totals[31_234] = 99_999
    mem = _mem([(T0 + i, i, 1, int(t)) for i, t in enumerate(totals)])
    out = me.analyse(mem, me.Sites([None] * n, [None] * n, [None] * n, [None] * n), "r", 0)
    assert len(out.points) <= me.TIMELINE_POINTS
    assert max(p.allocated_bytes for p in out.points) == 99_999


def test_failing_op_is_the_outermost_op_of_the_last_to_end() -> None:
    rows = [
        make_event("r", 0, "aten::linear", T0, 100, module="fc", step=0),
        make_event("r", 1, "aten::repeat", T0 + 500, 900, module="blocks.2", shapes="[[4096,64],[]]", step=2),
        make_event("r", 2, "aten::empty", T0 + 600, 799, depth=1, parent_id=1, module="blocks.2", step=2),
    ]
    site = me.failing_op(records_to_arrow(TraceEvent, rows))
    assert site is not None
    assert (site["op"], site["inner_op"], site["module"], site["step"]) == (
        "aten::repeat",
        "aten::empty",
        "blocks.2",
        2,
    )
    assert site["start_ns"] == T0 + 500
