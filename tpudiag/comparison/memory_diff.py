"""Peak memory of two runs compared: a regression only when both ran the same input shapes.

The snapshot's ``memory`` holds the run's peak (``memory_report``'s figure and source) and the distinct input
shapes of its steps; the peak of a run that fed bigger batches is not a regression, so a comparison with different
shapes (or a peak from different sources: a profiler peak against an RSS) says so instead of a ratio.
"""

from __future__ import annotations

from typing import Any

from tpudiag.comparison.snapshot import Snapshot


def memory_summary(section: dict[str, Any] | None, steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What a snapshot keeps of a run's memory section (None: no memory recorded)."""
    if section is None or section.get("peak_bytes") is None:
        return None
    return {
        "peak_bytes": int(section["peak_bytes"]),
        "source": section.get("source"),
        "input_shapes": sorted({s["input_shapes"] for s in steps if s.get("input_shapes")}),
        "oom": bool(section.get("oom")),
    }


def compare_memory(a: Snapshot, b: Snapshot) -> dict[str, Any] | None:
    ma, mb = a.memory, b.memory
    if ma is None or mb is None:
        return None
    same_shapes = ma["input_shapes"] == mb["input_shapes"]
    same_source = ma["source"] == mb["source"]
    return {
        "peak_a": ma["peak_bytes"],
        "peak_b": mb["peak_bytes"],
        "ratio": mb["peak_bytes"] / ma["peak_bytes"] if ma["peak_bytes"] else None,
        "source_a": ma["source"],
        "source_b": mb["source"],
        "same_shapes": same_shapes,
        "comparable": same_shapes and same_source,
        "oom_b": mb.get("oom", False),
    }
