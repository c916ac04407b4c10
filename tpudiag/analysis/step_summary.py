"""Step spans and the report's summary of them: plain Python, so reading a run never loads numpy or Arrow."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepSpan:
    step: int
    start_ns: int
    dur_ns: int
    kind: str
    input_shapes: str | None = None


def summarize_steps(
    steps: Sequence[StepSpan],
    span_ns: tuple[int, int] | None,
    script_s: float | None = None,
    tool_ns: Mapping[int, int] | None = None,
    tool_total_ns: int | None = None,
) -> dict[str, object]:
    """The report's ``steps`` object.

    ``steps_s`` (time inside steps) + ``outside_steps_s`` is the script's own duration when ``script_s`` (a
    capture's measured run time) is given: time outside steps is the rest of the script, not the rest of the
    trace, whose session starts before the script and ends after it.  Without it (an imported trace) the rest of
    ``span_ns`` is outside.  ``tool_ns`` (step -> ns) and ``tool_total_ns``: tpudiag's own time (the numerics
    checker), which runs inside the script and its steps; reported apart as ``tpudiag_in_steps_s`` /
    ``tpudiag_s``, with the steady median without it (``steady_median_without_tpudiag_s``).
    """
    if not steps:
        return no_steps(script_s, tool_total_ns)
    ordered = sorted(steps, key=lambda s: s.start_ns)
    durs = [s.dur_ns / 1e9 for s in ordered]
    steady = statistics.median(durs[1:]) if len(durs) > 1 else None
    covered = _union_length([(s.start_ns, s.start_ns + s.dur_ns) for s in ordered])
    outside = None
    if script_s is not None:
        outside = max(0.0, script_s - covered / 1e9)
    elif span_ns is not None:
        outside = max(0.0, (span_ns[1] - span_ns[0] - covered) / 1e9)
    out: dict[str, object] = {
        "count": len(ordered),
        "first_s": round(durs[0], 6),
        "steady_median_s": round(steady, 6) if steady is not None else None,
        "outside_steps_s": round(outside, 6) if outside is not None else None,
        "kind": ordered[0].kind,
        "steps_s": round(covered / 1e9, 6),
        "script_s": script_s,
    }
    if tool_ns is not None:
        own = [tool_ns.get(s.step, 0) / 1e9 for s in ordered]
        out["tpudiag_in_steps_s"] = round(sum(own), 6)
        out["tpudiag_s"] = _s(tool_total_ns) if tool_total_ns is not None else round(sum(own), 6)
        without = [d - t for d, t in zip(durs, own, strict=True)]
        out["steady_median_without_tpudiag_s"] = round(statistics.median(without[1:]), 6) if len(without) > 1 else None
    return out


def no_steps(script_s: float | None, tool_total_ns: int | None) -> dict[str, object]:
    """The ``steps`` object of a run without steps."""
    return {
        "count": 0,
        "first_s": None,
        "steady_median_s": None,
        "outside_steps_s": None,
        "kind": None,
        "steps_s": None,
        "script_s": script_s,
        "tpudiag_s": _s(tool_total_ns) if tool_total_ns else None,
    }


def _s(ns: int | None) -> float | None:
    return round(ns / 1e9, 6) if ns is not None else None


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
