"""Comparability first: the two runs' fingerprints side by side, what differs, and what makes them incomparable.

Some differences are the point of a comparison (torch 2.13 → 2.14, CPU → TPU, one commit → the next) and are only
stated.  Others mean the two runs did not do the same work (another script, other arguments, other input
shapes) or cannot be timed against each other (host times on one side, device times on the other); those are
*problems*.  Some problems only make the *times* incomparable (other input shapes, host against device times, steps
found another way): they are also listed as ``timing_problems``, and ``tpudiag check`` then reads its timing rules
as inconclusive while its count rules (divergent ops, recompiles, graph breaks: valid whatever the shapes) still
decide.  On the others (another script or arguments, a run that did not end ``ok``) it refuses to gate unless
told ``--allow-mismatch``.
"""

from __future__ import annotations

import json
from typing import Any

from tpudiag.comparison.snapshot import Snapshot

STATED = (
    "torch_version",
    "tpudiag_version",
    "python_version",
    "device_kind",
    "device_name",
    "precision",
    "env",
    "git_commit",
    "host",
    "collectors",
)
BLOCKING = ("script", "argv")


def input_shapes(s: Snapshot) -> list[Any]:
    """The distinct input shapes of the run's steps, in first-seen order."""
    seen: list[Any] = []
    for step in s.steps:
        text = step.get("input_shapes")
        value = json.loads(text) if isinstance(text, str) else text
        if value is not None and value not in seen:
            seen.append(value)
    return seen


def fingerprint(s: Snapshot) -> dict[str, Any]:
    fp = {k: s.run.get(k) for k in (*BLOCKING, *STATED)}
    fp["input_shapes"] = input_shapes(s)
    fp["step_kind"] = s.steps[0]["kind"] if s.steps else None
    fp["time_source"] = s.time_source
    return fp


def _dict_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, list[Any]]:
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def comparability(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    """The ``comparable`` section: ``ok``, both fingerprints, ``differences`` (stated), ``problems`` and, among
    them, ``timing_problems`` (those that leave counts comparable)."""
    fa, fb = fingerprint(a), fingerprint(b)
    differences: list[dict[str, Any]] = []
    problems: list[str] = []
    timing: list[str] = []
    for key in fa:
        va, vb = fa[key], fb[key]
        if va == vb:
            continue
        entry: dict[str, Any] = {"field": key, "a": va, "b": vb}
        if isinstance(va, dict) and isinstance(vb, dict):
            entry["changed"] = _dict_diff(va, vb)
        differences.append(entry)
        if key in BLOCKING:
            problems.append(f"{key} differs ({_short(va)} vs {_short(vb)}): the runs did not do the same work")
        elif key == "input_shapes" and fa[key] and fb[key]:
            timing.append("input shapes differ: step and op times measure different work")
        elif key == "time_source" and va and vb:
            timing.append(f"op times are {va} times in A and {vb} times in B: not comparable")
        elif key == "step_kind" and va and vb:
            timing.append(f"steps were found differently ({va} vs {vb}): step times are not comparable")
    problems.extend(timing)
    for label, s in (("A", a), ("B", b)):
        status = s.run.get("status")
        if status not in (None, "ok"):
            problems.append(f"run {label} ({s.label}) ended {status}: its data may be partial")
    return {
        "ok": not problems,
        "a": fa,
        "b": fb,
        "differences": differences,
        "problems": problems,
        "timing_problems": timing,
    }


def _short(v: Any) -> str:
    text = json.dumps(v, default=str)
    return text if len(text) <= 60 else text[:57] + "..."
