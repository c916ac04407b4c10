"""Ops aligned across two runs by (module path, op), each put in one category: added, removed, slower, faster or
unchanged, ranked by how much of the step time its change accounts for.

Each op's samples are its self time in every steady step (0 in a step where it did not run), averaged over the
same blocks of consecutive steps as the step times (``stats.block_ids``) and compared with the rank test; p-values
of the ops that matter (at least ``MIN_SHARE`` of step time on either side) are adjusted with Benjamini–Hochberg,
and an op is slower/faster only when that is significant, its ratio passes ``FACTOR`` and its per-step change
passes an absolute floor.  When nearly every op moved by one common factor the cause is the machine (contention,
clock), not the code: the section says so ("uniform shift") and ops are then judged on their share of the step,
i.e. B's times divided by the common factor.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tpudiag.comparison import stats
from tpudiag.comparison.snapshot import Snapshot
from tpudiag.comparison.steps_diff import WARMUP_STEPS

FACTOR = 1.10
MIN_SHARE = 0.01
FLOOR_S = 1e-6
FLOOR_SHARE = 0.005  # of the steady step time
UNIFORM_MIN_SHIFT = 0.10  # a common factor closer to 1 than this is no shift
UNIFORM_BAND = 0.25  # an op within ×/÷ (1 + this) of the common factor moved with the crowd
UNIFORM_WEIGHT = 0.75  # share of the ops' time that must have moved with the crowd
UNIFORM_MIN_OPS = 3


def _steady_steps(s: Snapshot, warmup: int) -> list[int]:
    skip = set(s.checker_steps)
    return [st["step"] for st in s.steps[warmup:] if st["step"] not in skip]


def _samples(op: dict[str, Any], steps: list[int]) -> list[float]:
    per = {int(k): v for k, v in op.get("per_step") or []}
    return [per.get(st, 0) / 1e9 for st in steps]


def _key(op: dict[str, Any]) -> tuple[str, str | None]:
    return op["name"], op.get("module")


def uniform_shift(pairs: list[tuple[float, float, float]]) -> dict[str, Any] | None:
    """``pairs``: (median A, median B, weight) of ops on both sides.  The common factor when nearly all moved by it."""
    usable = [(ma, mb, w) for ma, mb, w in pairs if ma > 0 and mb > 0 and w > 0]
    if len(usable) < UNIFORM_MIN_OPS:
        return None
    logs = np.array([math.log(mb / ma) for ma, mb, _ in usable])
    weights = np.array([w for _, _, w in usable])
    order = np.argsort(logs)
    cum = np.cumsum(weights[order]) / weights.sum()
    center = float(logs[order][np.searchsorted(cum, 0.5)])  # weighted median of the log ratios
    factor = math.exp(center)
    inside = np.abs(logs - center) <= math.log(1 + UNIFORM_BAND)
    moved_with_crowd = float(weights[inside].sum() / weights.sum())
    if abs(factor - 1.0) < UNIFORM_MIN_SHIFT or moved_with_crowd < UNIFORM_WEIGHT:
        return None
    return {
        "factor": round(factor, 4),
        "ops": len(usable),
        "time_share_moving_together": round(moved_with_crowd, 4),
        "notice": f"uniform shift: nearly every op moved by ×{factor:.2f} — machine contention or clock, not code; "
        "ops are judged on their share of step time",
    }


def compare_ops(
    a: Snapshot, b: Snapshot, warmup: int = WARMUP_STEPS, alpha: float = stats.ALPHA, factor: float = FACTOR
) -> dict[str, Any]:
    """The ``ops`` section: ``entries`` (every aligned op), ``counts`` per category, ``uniform_shift``."""
    # Host times on one side and device times on the other are listed side by side, never judged.
    comparable = not (a.time_source and b.time_source and a.time_source != b.time_source)
    steps_a, steps_b = _steady_steps(a, warmup), _steady_steps(b, warmup)
    step_a = [st["dur_ns"] / 1e9 for st in a.steps if st["step"] in set(steps_a)]
    step_b = [st["dur_ns"] / 1e9 for st in b.steps if st["step"] in set(steps_b)]
    step_med_a = float(np.median(step_a)) if step_a else None
    step_med_b = float(np.median(step_b)) if step_b else None
    blocks_a, blocks_b = stats.block_ids(step_a), stats.block_ids(step_b)
    ops_a = {_key(o): o for o in a.ops}
    ops_b = {_key(o): o for o in b.ops}
    rows: list[dict[str, Any]] = []
    pairs: list[tuple[float, float, float]] = []
    for key in list(ops_a) + [k for k in ops_b if k not in ops_a]:
        oa, ob = ops_a.get(key), ops_b.get(key)
        sa = stats.block_means(_samples(oa, steps_a), blocks_a) if oa else []
        sb = stats.block_means(_samples(ob, steps_b), blocks_b) if ob else []
        row: dict[str, Any] = {
            "op": key[0],
            "module": key[1],
            "calls_a": oa["calls"] if oa else 0,
            "calls_b": ob["calls"] if ob else 0,
            "self_ns_a": int(oa["self_ns"]) if oa else 0,
            "self_ns_b": int(ob["self_ns"]) if ob else 0,
            "self_s_a": oa["self_ns"] / 1e9 if oa else None,
            "self_s_b": ob["self_ns"] / 1e9 if ob else None,
            "per_step_s_a": float(np.median(sa)) if sa else None,
            "per_step_s_b": float(np.median(sb)) if sb else None,
            "_sa": sa,
            "_sb": sb,
        }
        if oa and ob and (oa.get("shapes") or ob.get("shapes")) and oa.get("shapes") != ob.get("shapes"):
            row["shapes_a"], row["shapes_b"] = oa.get("shapes"), ob.get("shapes")
        share = max(
            (row["per_step_s_a"] or 0.0) / step_med_a if step_med_a else 0.0,
            (row["per_step_s_b"] or 0.0) / step_med_b if step_med_b else 0.0,
        )
        row["share"] = round(share, 6)
        if oa and ob and sa and sb:
            pairs.append((float(np.mean(sa)), float(np.mean(sb)), (row["per_step_s_a"] or 0.0) + 1e-12))
        rows.append(row)
    shift = uniform_shift(pairs) if comparable else None
    scale = 1.0 / shift["factor"] if shift else 1.0
    tested = [r for r in rows if comparable and r["_sa"] and r["_sb"] and r["share"] >= MIN_SHARE]
    pvals = [stats.mann_whitney(r["_sa"], [v * scale for v in r["_sb"]]) for r in tested]
    for r, q in zip(tested, stats.benjamini_hochberg(pvals), strict=True):
        r["q_value"] = q
    floor = max(FLOOR_S, FLOOR_SHARE * (step_med_a or 0.0))
    for r in rows:
        r["category"], r["verdict"], r["ratio"] = _categorize(r, scale, alpha, factor, floor)
        if not comparable and r["category"] not in ("added", "removed"):
            r["category"] = r["verdict"] = "not comparable"
        delta = ((r["per_step_s_b"] or 0.0) * scale) - (r["per_step_s_a"] or 0.0)
        r["impact"] = round(delta / step_med_a, 6) if step_med_a else None
        r["delta_s"] = round(delta, 9)
        del r["_sa"], r["_sb"]
    rows.sort(key=lambda r: (-(abs(r["impact"]) if r["impact"] is not None else 0.0), r["op"], str(r["module"])))
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["category"]] = counts.get(r["category"], 0) + 1
    out = {
        "comparable": comparable,
        "time_source": a.time_source or b.time_source,
        "entries": rows,
        "counts": counts,
        "uniform_shift": shift,
        "steady_steps": [len(steps_a), len(steps_b)],
    }
    if not comparable:
        out["note"] = f"op times are {a.time_source} times in A and {b.time_source} times in B: listed, not judged"
    return out


def _categorize(r: dict[str, Any], scale: float, alpha: float, factor: float, floor: float) -> tuple[str, str, Any]:
    if not r["calls_a"]:
        return "added", "added", None
    if not r["calls_b"]:
        return "removed", "removed", None
    ma, mb = r["per_step_s_a"], r["per_step_s_b"]
    if ma is None or mb is None:  # no steps: totals only, never a verdict
        ratio = r["self_s_b"] / r["self_s_a"] if r["self_s_a"] else None
        return "unchanged", "too few samples", round(ratio, 4) if ratio is not None else None
    mb *= scale
    ratio = mb / ma if ma > 0 else (math.inf if mb > 0 else 1.0)
    q = r.get("q_value")
    if q is None:
        verdict = "too few samples" if stats.min_pvalue(len(r["_sa"]), len(r["_sb"])) >= alpha else "below 1% of step"
        return "unchanged", verdict, _round(ratio)
    significant = q < alpha and abs(mb - ma) > floor
    if significant and ratio > factor:
        return "slower", "slower", _round(ratio)
    if significant and ratio < 1 / factor:
        return "faster", "faster", _round(ratio)
    return (
        "unchanged",
        "no significant change" if stats.min_pvalue(len(r["_sa"]), len(r["_sb"])) < alpha else ("too few samples"),
        _round(ratio),
    )


def _round(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 4)
