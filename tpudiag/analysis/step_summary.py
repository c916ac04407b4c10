"""Step spans and the report's summary of them: plain Python, so reading a run never loads numpy or Arrow."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepSpan:
    step: int
    start_ns: int
    dur_ns: int
    kind: str
    input_shapes: str | None = None


def summarize_steps(steps: Sequence[StepSpan], span_ns: tuple[int, int] | None) -> dict[str, object]:
    """The report's ``steps`` object."""
    if not steps:
        return {"count": 0, "first_s": None, "steady_median_s": None, "outside_steps_s": None, "kind": None}
    ordered = sorted(steps, key=lambda s: s.start_ns)
    durs = [s.dur_ns / 1e9 for s in ordered]
    steady = statistics.median(durs[1:]) if len(durs) > 1 else None
    outside = None
    if span_ns is not None:
        covered = _union_length([(s.start_ns, s.start_ns + s.dur_ns) for s in ordered])
        outside = max(0.0, (span_ns[1] - span_ns[0] - covered) / 1e9)
    return {
        "count": len(ordered),
        "first_s": round(durs[0], 6),
        "steady_median_s": round(steady, 6) if steady is not None else None,
        "outside_steps_s": round(outside, 6) if outside is not None else None,
        "kind": ordered[0].kind,
    }


def _union_length(intervals: list[tuple[int, int]]) -> int:
    total = 0
    cur_lo: int | None = None
    cur_hi = 0
    for lo, hi in sorted(intervals):
        if cur_lo is None or lo > cur_hi:
            if cur_lo is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_lo is not None:
        total += cur_hi - cur_lo
    return total
