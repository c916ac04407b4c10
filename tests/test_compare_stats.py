"""The comparison's statistics and its machine-wide-shift guard, on known distributions and hand-built runs.

The uniform-shift case is built from records (tests/factories.py): run B is run A with every op and step
duration multiplied by 1.6 and fresh jitter, i.e. what a machine running everything slower looks like, without
depending on how loaded this machine happens to be.
"""

from __future__ import annotations

import copy
import io
import math
import random
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import numpy as np
import pytest

from tests.factories import make_event, make_run, make_step, store_with
from tpudiag.cli import main
from tpudiag.comparison import stats
from tpudiag.comparison.compare import compare, findings
from tpudiag.comparison.source import snapshot_of
from tpudiag.model import Step, TraceEvent
from tpudiag.store import Store


def test_rank_test_exact_and_approximate() -> None:
    a, b = [1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0]
    # Fully separated 5 vs 5: the most extreme of C(10, 5) = 252 arrangements, on both tails.
    assert stats.mann_whitney(a, b) == pytest.approx(2 / 252)
    assert stats.mann_whitney(b, a) == stats.mann_whitney(a, b)
    assert stats.min_pvalue(5, 5) == pytest.approx(2 / 252)
    assert stats.mann_whitney(a, a) == 1.0
    assert stats.mann_whitney([], b) == 1.0
    rng = np.random.default_rng(3)
    same = [stats.mann_whitney(rng.normal(size=30), rng.normal(size=30)) for _ in range(400)]
    # Under the null hypothesis p is (close to) uniform: about 1% of p-values fall below 0.01.
    assert sum(p < 0.01 for p in same) <= 12
    assert stats.mann_whitney(rng.normal(size=30), rng.normal(1.0, 1, size=30)) < 1e-3
    ties = [1.0] * 10 + [2.0] * 10
    assert stats.mann_whitney(ties, [2.0] * 10 + [3.0] * 10) < 0.01


def test_median_interval_covers_the_median_at_its_level() -> None:
    assert stats.median_ci(list(range(1, 21))) == (6.0, 15.0)  # the textbook order statistics for n = 20
    assert stats.median_ci([1.0]) is None
    rng = np.random.default_rng(5)
    true_median = math.log(2)  # of Exp(1)
    hits = 0
    for _ in range(500):
        lo, hi = stats.median_ci(rng.exponential(size=25))  # type: ignore[misc]
        hits += lo <= true_median <= hi
    assert hits / 500 >= 0.93


def test_benjamini_hochberg_and_verdicts() -> None:
    p = [0.01, 0.04, 0.03, 0.5]
    m = len(p)
    expected = [min(1.0, min(sorted(p)[k] * m / (k + 1) for k in range(r, m))) for r in range(m)]
    by_rank = dict(zip(sorted(range(m), key=lambda i: p[i]), expected, strict=True))
    assert stats.benjamini_hochberg(p) == pytest.approx([by_rank[i] for i in range(m)])
    assert stats.compare_samples([1.0, 1.1, 1.2], [2.0, 2.1, 2.2]).verdict == "too few samples"
    rng = np.random.default_rng(7)
    base = rng.normal(10, 0.1, size=40)
    assert stats.compare_samples(base, base * 1.2).verdict == "slower"
    assert stats.compare_samples(base, base * 0.8).verdict == "faster"
    assert stats.compare_samples(base, rng.normal(10, 0.1, size=40)).verdict == "no significant change"
    noisy = rng.lognormal(0, 0.6, size=40)
    d = stats.compare_samples(noisy, rng.lognormal(0, 0.6, size=40))
    assert d.verdict == "unstable" and d.cv_a is not None and d.cv_a >= stats.UNSTABLE_CV
    # A significant but tiny change is not a change (noise threshold).
    assert stats.compare_samples(base, base * 1.004).verdict == "no significant change"


# Steps of about 0.13 s: each is a block of its own (stats.BLOCK_S), so 30 steps are 30 samples.
def test_steps_are_pooled_into_blocks_of_time() -> None:
    assert stats.block_ids([0.03] * 10, 0.1) == [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]  # a short tail joins the last block
    assert stats.block_ids([0.5, 0.5, 0.5], 0.1) == [0, 1, 2]  # a long step is a block of its own
    assert stats.block_ids([0.01, 0.01], 0.1) == [0, 0]
    assert stats.block_means([1.0, 3.0, 5.0, 7.0], [0, 0, 1, 1]) == [2.0, 6.0]


def test_two_short_runs_at_different_machine_speeds_are_no_verdict() -> None:
    """The CI failure this guards: 22 steps of 1 ms each, one run on a machine 1.6× slower at that moment.  Every
    step of a run shares its moment's speed, so the per-step rank test is certain (p ~ 1e-8) of a change the code
    did not make; over blocks the same runs are one sample each: too few samples."""
    rng = np.random.default_rng(3)
    a = 0.001 * rng.uniform(0.97, 1.03, size=22)
    b = 0.0016 * rng.uniform(0.97, 1.03, size=22)
    assert stats.compare_samples(a, b).verdict == "slower"
    d = stats.compare_blocked(a, b)
    assert d.verdict == "too few samples" and (d.blocks_a, d.blocks_b) == (1, 1) and d.n_a == 22
    assert d.median_b == pytest.approx(float(np.median(b)))  # the medians stay per step
    # Long enough runs still get their verdict, from blocks: 3 s of 1 ms steps, 30% slower.
    a_long = 0.001 * rng.uniform(0.9, 1.1, size=3000)
    b_long = 0.0013 * rng.uniform(0.9, 1.1, size=3000)
    d = stats.compare_blocked(a_long, b_long)
    assert d.verdict == "slower" and d.blocks_a in (29, 30) and d.blocks_b in (38, 39)


OPS = {"aten::mm": 80_000_000, "aten::add": 24_000_000, "aten::relu": 12_000_000, "aten::sum": 16_000_000}


def _hand_built(store: Store, name: str, scale: float, seed: int, extra: dict[str, float] | None = None) -> str:
    """30 steps of four ops; every duration times ``scale`` (``extra``: an op's own further factor)."""
    rng = random.Random(seed)
    run = make_run(name=name)
    events, steps = [], []
    t = 1_000_000
    eid = 0
    for step in range(30):
        start = t
        for op, base in OPS.items():
            dur = int(base * scale * (extra or {}).get(op, 1.0) * rng.uniform(0.95, 1.05))
            events.append(make_event(run.id, eid, op, t, dur, step=step, module="net.block"))
            eid += 1
            t += dur + 1000
        steps.append(make_step(run.id, step, start, t - start))
        t += 5000
    store_with(store, run, {TraceEvent: events, Step: steps})
    return run.id


@pytest.fixture(scope="module")
def shifted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, dict[str, str]]:
    store = Store(tmp_path_factory.mktemp("shift") / "store.duckdb")
    ids = {
        "a": _hand_built(store, "a", 1.0, 1),
        "machine": _hand_built(store, "machine", 1.6, 2),
        "machine_and_mm": _hand_built(store, "machine_and_mm", 1.6, 3, {"aten::relu": 3.0}),
    }
    return store, ids


def test_machine_wide_slowdown_is_a_uniform_shift_not_op_regressions(shifted: tuple[Store, dict[str, str]]) -> None:
    store, ids = shifted
    a, b = snapshot_of(store, ids["a"]), snapshot_of(store, ids["machine"])
    before = (copy.deepcopy(a), copy.deepcopy(b))
    result = compare(a, b)
    assert (a, b) == before  # pure: inputs untouched
    shift = result["ops"]["uniform_shift"]
    assert shift is not None and shift["factor"] == pytest.approx(1.6, rel=0.03)
    assert {e["category"] for e in result["ops"]["entries"]} == {"unchanged"}
    assert result["steps"]["steady"]["verdict"] == "slower"  # the steps did get slower ...
    titles = [f.title for f in findings(result)]
    assert "uniform shift" in titles and not [t for t in titles if t.startswith("aten::")]


def test_an_op_that_moved_beyond_the_shift_is_still_named(shifted: tuple[Store, dict[str, str]]) -> None:
    store, ids = shifted
    result = compare(snapshot_of(store, ids["a"]), snapshot_of(store, ids["machine_and_mm"]))
    assert result["ops"]["uniform_shift"]["factor"] == pytest.approx(1.6, rel=0.05)
    cats = {e["op"]: e["category"] for e in result["ops"]["entries"]}
    assert cats == {"aten::mm": "unchanged", "aten::add": "unchanged", "aten::sum": "unchanged", "aten::relu": "slower"}
    relu = next(e for e in result["ops"]["entries"] if e["op"] == "aten::relu")
    assert relu["ratio"] == pytest.approx(3.0, rel=0.05)  # judged on its share: 1.6 × 3 / 1.6


def test_the_gate_calls_a_machine_wide_shift_inconclusive(
    shifted: tuple[Store, dict[str, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, ids = shifted
    monkeypatch.chdir(tmp_path)  # no pyproject.toml here: the default rules
    out = io.StringIO()
    with redirect_stdout(out), redirect_stderr(io.StringIO()):
        code = main(["check", ids["machine"], "--baseline", ids["a"], "--db", str(store.path)])
    assert code == 3, out.getvalue()
    assert "INCONCLUSIVE steps.steady" in out.getvalue() and "uniform shift" in out.getvalue()
    out = io.StringIO()
    with redirect_stdout(out):
        code = main(["check", ids["machine_and_mm"], "--baseline", ids["a"], "--db", str(store.path)])
    assert code == 3  # steps: machine; the relu regression is reported by compare, gated only with ops.time
