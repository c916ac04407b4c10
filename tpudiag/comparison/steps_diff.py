"""Step times compared: time to first result (the first step) and steady-state step time (the steps after
warm-up), each as a median with its interval, the ratio B/A and a verdict from the rank test.  The steady steps are
tested in blocks of at least ``stats.BLOCK_S`` seconds, since steps closer in time than that share the machine's
speed of the moment (``stats.block_ids``).

Steps during which the numerics checker worked are left out of the steady state (they time tpudiag).  With one
run per side the first step is a single sample, so its verdict is "too few samples" by construction: it is
reported, never gated on.
"""

from __future__ import annotations

from typing import Any

from tpudiag.comparison import stats
from tpudiag.comparison.snapshot import Snapshot

WARMUP_STEPS = 1


def steady_samples(s: Snapshot, warmup: int = WARMUP_STEPS) -> list[float]:
    """Steady-state step times in seconds."""
    skip = set(s.checker_steps)
    return [st["dur_ns"] / 1e9 for st in s.steps[warmup:] if st["step"] not in skip]


def first_sample(s: Snapshot) -> list[float]:
    return [s.steps[0]["dur_ns"] / 1e9] if s.steps else []


def compare_steps(a: Snapshot, b: Snapshot, warmup: int = WARMUP_STEPS, alpha: float = stats.ALPHA) -> dict[str, Any]:
    """The ``steps`` section: ``first`` and ``steady``, each a ``Difference`` as a dict, in seconds."""
    out: dict[str, Any] = {
        "count_a": len(a.steps),
        "count_b": len(b.steps),
        "warmup_steps": warmup,
        "excluded_checker_steps": [len(a.checker_steps), len(b.checker_steps)],
        "unit": "s",
    }
    if not a.steps or not b.steps:
        out["first"] = out["steady"] = None
        out["note"] = "a run has no steps (no trace captured?): step times not compared"
        return out
    out["first"] = stats.compare_samples(first_sample(a), first_sample(b), alpha).to_dict()
    out["steady"] = stats.compare_blocked(steady_samples(a, warmup), steady_samples(b, warmup), alpha).to_dict()
    out["block_s"] = stats.BLOCK_S
    return out
