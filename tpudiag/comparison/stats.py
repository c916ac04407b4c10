"""Statistics for noisy timings: medians with distribution-free intervals, the Mann–Whitney U test, a bootstrap
interval of the ratio of medians, Benjamini–Hochberg, and the verdict that combines them.

Plain numpy (no scipy): the exact U distribution is counted for small samples without ties, the normal
approximation with tie correction is used otherwise.  The verdict never calls noise a change: a difference is
"faster"/"slower" only when the test is significant *and* the ratio is beyond a small noise threshold; samples
too small to ever reach the significance level are "too few samples", noisy ones that show nothing "unstable"
(asv's ``is_different``, Criterion's noise threshold, pyperf's stability warning).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

ALPHA = 0.01
CONFIDENCE = 0.95
NOISE_THRESHOLD = 0.01  # |ratio - 1| below this is never a change, however significant
UNSTABLE_CV = 0.10  # robust coefficient of variation (1.4826·MAD / median) from which a sample is unstable
BOOTSTRAP_ROUNDS = 2000
BLOCK_S = 0.1  # consecutive steps are pooled into blocks of at least this many seconds before they are tested
_EXACT_MAX = 400  # n1*n2 up to which the exact U distribution is counted

Samples = Sequence[float] | np.ndarray[Any, Any]
VERDICTS = ("faster", "slower", "no significant change", "too few samples", "unstable")


def median_ci(values: Samples, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """A distribution-free interval of the median from order statistics (binomial, as asv does); None if n < 2."""
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    if n < 2:
        return None
    # The largest k with P(Binom(n, 1/2) < k) <= (1 - confidence) / 2: [x_(k), x_(n-k+1)] covers the median.
    tail = (1.0 - confidence) / 2.0
    cdf = 0.0
    k = 0
    for i in range(n + 1):
        p = math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) - n * math.log(2))
        if cdf + p > tail:
            break
        cdf += p
        k = i + 1
    if k == 0:  # too few values for this confidence: the whole range
        return float(x[0]), float(x[-1])
    return float(x[k - 1]), float(x[n - k])


def robust_cv(values: Samples) -> float | None:
    x = np.asarray(values, dtype=float)
    if len(x) < 3:
        return None
    med = float(np.median(x))
    if med <= 0:
        return None
    return float(1.4826 * np.median(np.abs(x - med)) / med)


def _exact_u_pvalue(u: float, n1: int, n2: int) -> float:
    """Two-sided exact p-value of U (no ties) by counting rank arrangements."""
    # counts[k] = number of arrangements with U = k, built by the classic recurrence over (n1, n2).
    table = np.zeros((n1 + 1, n2 + 1, n1 * n2 + 1))
    table[0, :, 0] = 1.0
    table[:, 0, 0] = 1.0
    for i in range(1, n1 + 1):
        for j in range(1, n2 + 1):
            shifted = np.zeros(n1 * n2 + 1)
            shifted[j:] = table[i - 1, j, : n1 * n2 + 1 - j]
            table[i, j] = shifted + table[i, j - 1]
    counts = table[n1, n2]
    total = counts.sum()
    lo = min(u, n1 * n2 - u)
    p = 2.0 * counts[: math.floor(lo) + 1].sum() / total
    return float(min(1.0, p))


def mann_whitney(a: Samples, b: Samples) -> float:
    """Two-sided Mann–Whitney U p-value (1.0 when a side is empty or every value ties)."""
    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    n1, n2 = len(x), len(y)
    if n1 == 0 or n2 == 0:
        return 1.0
    both = np.concatenate([x, y])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    uniq, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    if len(uniq) < len(both):  # average ranks over ties
        sums = np.zeros(len(uniq))
        np.add.at(sums, inverse, ranks)
        ranks = (sums / counts)[inverse]
    u = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2.0)
    ties = counts[counts > 1]
    if len(ties) == 0 and n1 * n2 <= _EXACT_MAX:
        return _exact_u_pvalue(u, n1, n2)
    n = n1 + n2
    var = n1 * n2 / 12.0 * ((n + 1) - float((ties**3 - ties).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0
    z = (abs(u - n1 * n2 / 2.0) - 0.5) / math.sqrt(var)
    return float(min(1.0, math.erfc(max(z, 0.0) / math.sqrt(2.0))))


def min_pvalue(n1: int, n2: int) -> float:
    """The smallest two-sided p-value the rank test can reach with these sample sizes (asv's ``p_min``)."""
    if n1 == 0 or n2 == 0:
        return 1.0
    log_ways = math.lgamma(n1 + n2 + 1) - math.lgamma(n1 + 1) - math.lgamma(n2 + 1)
    return min(1.0, 2.0 * math.exp(-log_ways))  # 2 / C(n1 + n2, n1), without the huge integer


def ratio_ci(
    a: Samples, b: Samples, confidence: float = CONFIDENCE, rounds: int = BOOTSTRAP_ROUNDS
) -> tuple[float, float] | None:
    """Percentile bootstrap interval of median(b) / median(a); seeded, so the same inputs give the same output."""
    x = np.asarray(a, dtype=float)
    y = np.asarray(b, dtype=float)
    if len(x) < 2 or len(y) < 2:
        return None
    rng = np.random.default_rng(20260)
    mx = np.median(x[rng.integers(0, len(x), size=(rounds, len(x)))], axis=1)
    my = np.median(y[rng.integers(0, len(y), size=(rounds, len(y)))], axis=1)
    ok = mx > 0
    if not ok.any():
        return None
    ratios = my[ok] / mx[ok]
    lo, hi = np.quantile(ratios, [(1 - confidence) / 2, 1 - (1 - confidence) / 2])
    return float(lo), float(hi)


def benjamini_hochberg(pvalues: Samples) -> list[float]:
    """BH-adjusted p-values (q-values), in the input order."""
    p = np.asarray(pvalues, dtype=float)
    n = len(p)
    if n == 0:
        return []
    order = np.argsort(p)
    adjusted = p[order] * n / np.arange(1, n + 1)
    adjusted = np.minimum.accumulate(adjusted[::-1])[::-1]
    out = np.empty(n)
    out[order] = np.minimum(adjusted, 1.0)
    return [float(v) for v in out]


@dataclass(frozen=True)
class Difference:
    """Two samples of one timing compared: each median with its interval, the ratio, the test, the verdict."""

    n_a: int
    n_b: int
    median_a: float | None
    median_b: float | None
    ci_a: tuple[float, float] | None
    ci_b: tuple[float, float] | None
    ratio: float | None  # median_b / median_a
    ratio_ci: tuple[float, float] | None
    p_value: float | None
    verdict: str
    cv_a: float | None = None
    cv_b: float | None = None
    blocks_a: int | None = None  # the samples the test saw, when steps were pooled into blocks
    blocks_b: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for key in ("ci_a", "ci_b", "ratio_ci"):
            if out[key] is not None:
                out[key] = list(out[key])
        return out


def verdict_of(p_value: float | None, ratio: float | None, p_min: float, unstable: bool, alpha: float) -> str:
    if p_value is None or ratio is None or p_min >= alpha:
        return "too few samples"
    if p_value < alpha and abs(ratio - 1.0) > NOISE_THRESHOLD:
        return "slower" if ratio > 1.0 else "faster"
    return "unstable" if unstable else "no significant change"


def _medians(a: Samples, b: Samples) -> tuple[float | None, float | None, float | None]:
    """median A, median B and their ratio B/A (None where a side is empty or A's median is 0)."""
    med_a = float(np.median(a)) if len(a) else None
    med_b = float(np.median(b)) if len(b) else None
    return med_a, med_b, (med_b / med_a if med_a and med_b is not None else None)


def _sample_summary(a: Samples, b: Samples) -> dict[str, Any]:
    """The fields of a ``Difference`` that describe the samples themselves: counts, medians, their intervals, the
    ratio of the medians."""
    med_a, med_b, ratio = _medians(a, b)
    return {
        "n_a": len(a),
        "n_b": len(b),
        "median_a": med_a,
        "median_b": med_b,
        "ci_a": median_ci(a),
        "ci_b": median_ci(b),
        "ratio": ratio,
    }


def compare_samples(a: Samples, b: Samples, alpha: float = ALPHA) -> Difference:
    """The full comparison of two timing samples (same unit on both sides)."""
    summary = _sample_summary(a, b)
    p_min = min_pvalue(len(a), len(b))
    p = mann_whitney(a, b) if len(a) and len(b) else None
    cv_a, cv_b = robust_cv(a), robust_cv(b)
    unstable = any(cv is not None and cv >= UNSTABLE_CV for cv in (cv_a, cv_b))
    return Difference(
        **summary,
        ratio_ci=ratio_ci(a, b),
        p_value=p,
        verdict=verdict_of(p, summary["ratio"], p_min, unstable, alpha),
        cv_a=cv_a,
        cv_b=cv_b,
    )


def block_ids(durations_s: Samples, block_s: float = BLOCK_S) -> list[int]:
    """The block of each step, in time order: consecutive steps are pooled until a block holds ``block_s`` seconds
    (a longer step is a block of its own; a short tail joins the block before it).

    A shared machine's speed drifts by tens of percent over fractions of a second to seconds, so steps a
    millisecond apart share the speed of their moment and are not independent samples: a rank test over them
    calls a drift between two short runs a significant change.  Blocks are far enough apart to be counted as
    samples, and a run too short to fill several has too few samples for a verdict, as it should."""
    ids: list[int] = []
    current, filled = 0, 0.0
    for d in np.asarray(durations_s, dtype=float):
        ids.append(current)
        filled += float(d)
        if filled >= block_s:
            current, filled = current + 1, 0.0
    if filled and current > 0:
        ids = [min(i, current - 1) for i in ids]
    return ids


def block_means(values: Samples, ids: Sequence[int]) -> list[float]:
    """The mean of ``values`` in each block (``ids`` from ``block_ids``, same order and length)."""
    x = np.asarray(values, dtype=float)
    if not len(x):
        return []
    groups = np.asarray(ids, dtype=int)
    sums = np.bincount(groups, weights=x)
    counts = np.bincount(groups)
    return [float(v) for v in sums[counts > 0] / counts[counts > 0]]


def compare_blocked(a: Samples, b: Samples, alpha: float = ALPHA, block_s: float = BLOCK_S) -> Difference:
    """Step times compared: medians and their intervals over the steps, the test, the ratio's interval and the
    verdict over blocks of consecutive steps (``block_ids``)."""
    ma, mb = block_means(a, block_ids(a, block_s)), block_means(b, block_ids(b, block_s))
    return replace(compare_samples(ma, mb, alpha), **_sample_summary(a, b), blocks_a=len(ma), blocks_b=len(mb))


def sample_count(d: dict[str, Any]) -> str:
    """``Difference.to_dict()``'s sample sizes as people read them: ``22+22``, or ``600+600 in 9+28 blocks``."""
    blocks = f" in {d['blocks_a']}+{d['blocks_b']} blocks" if d.get("blocks_a") is not None else ""
    return f"{d['n_a']}+{d['n_b']}{blocks}"
