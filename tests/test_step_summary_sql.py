"""The report's step summary is computed in SQL (memory flat in the number of steps) and equals the pure-Python
``summarize_steps`` over every step, on a real DuckDB store: ties, overlaps across ranks, odd/even medians,
tpudiag's own time inside steps, one step, no steps."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tpudiag import report
from tpudiag.analysis.step_summary import StepSpan, summarize_steps
from tpudiag.model import Run, Step, TraceEvent, records_to_arrow
from tpudiag.store import Store, queries, step_queries
from tpudiag.store.bulk_insert import insert_arrow

MS = 1_000_000


def _store(tmp_path: Path, steps: list[Step], events: list[TraceEvent], duration_s: float | None) -> Store:
    store = Store(tmp_path / "s.duckdb")
    with store.writer() as w:
        store.put_run(Run(id="r", name="t", status="ok", started_at=0.0, duration_s=duration_s), con=w)
        insert_arrow(w, "steps", records_to_arrow(Step, steps))
        insert_arrow(w, "trace_events", records_to_arrow(TraceEvent, events))
    return store


def _python_summary(store: Store, run: dict[str, Any]) -> dict[str, Any]:
    """What ``report.steps_section`` computed before it moved to SQL: every step in Python."""
    rows = queries.steps(store, "r")
    spans = [StepSpan(r["step"], r["start_ns"], r["dur_ns"], r["kind"], r["input_shapes"]) for r in rows]
    tool, total = step_queries.tool_ns_by_step(store, "r")
    out = summarize_steps(
        spans, step_queries.op_span_ns(store, "r"), run.get("duration_s"), tool if total else None, total or None
    )
    out["per_step"] = [
        {
            "step": s.step,
            "dur_s": round(s.dur_ns / 1e9, 6),
            **({"tpudiag_s": round(tool.get(s.step, 0) / 1e9, 6)} if total else {}),
            "input_shapes": None,
        }
        for s in spans[: report.MAX_STEPS_LISTED]
    ]
    return out


def _event(i: int, name: str, start_ns: int, dur_ns: int, category: str = "user_annotation") -> TraceEvent:
    return TraceEvent("r", i, "kineto", "p", "t", name, category, start_ns, dur_ns, dur_ns)


def _ranks_job(ranks: int, steps: int, seed: int) -> list[Step]:
    rng = random.Random(seed)
    out = []
    for rank in range(ranks):
        t = rng.randrange(0, 3) * MS  # ranks start together or nearly: overlapping, some exactly tied
        for s in range(steps):
            dur = rng.choice([5, 7, 7, 9, 30]) * MS + rng.randrange(0, 3)
            out.append(Step("r", s, t, dur, "optimizer", rank=rank))
            t += dur + rng.choice([0, 0, MS])
    return out


CASES = {
    "ranks_overlapping_even": (_ranks_job(4, 50, 1), 1.0),
    "ranks_overlapping_odd": (_ranks_job(3, 41, 2), None),
    "gaps_and_ties": (
        [
            Step("r", i, start * MS, dur * MS, "optimizer", rank=i % 2)
            for i, (start, dur) in enumerate([(0, 10), (0, 10), (5, 3), (20, 5), (40, 1), (40, 2), (100, 7)])
        ],
        0.5,
    ),
    "one_step": ([Step("r", 0, 0, 3 * MS, "whole")], 0.01),
    "no_steps": ([], 0.01),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("with_tool", [False, True])
def test_sql_summary_equals_python(tmp_path: Path, case: str, with_tool: bool) -> None:
    steps, duration = CASES[case]
    events = [_event(0, "aten::mm", 0, 200 * MS, "cpu_op")]
    if with_tool:  # the numerics checker's ranges and dispatch wrapper inside some steps
        events += [_event(1 + i, "tpudiag::check", s.start_ns + 1, s.dur_ns // 3) for i, s in enumerate(steps[::3])]
        events += [_event(10_000, "PythonDispatchMode", 2 * MS, MS, "cpu_op")]
    store = _store(tmp_path, steps, events, duration)
    run = queries.resolve_run(store, "r")
    got = report.steps_section(store, "r", run)
    want = _python_summary(store, run)
    assert got == want
    assert got["count"] == len(steps)
    assert ("tpudiag_in_steps_s" in got) == (with_tool and bool(steps))
