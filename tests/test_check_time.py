"""A settled step's check time (issue 21: no step of a long run stalled by tpudiag for more than 50 ms outside
trace windows).  Once a step's ``sampling.CHECK_STEP_S`` has run out its later calls are only counted (the mode's
own work per call had gone on to the step's end: a re-check step of the bench loop on a slow machine stalled 50 ms
for 30 ms of checks), a re-check round goes on in the next periodic step, and past the run's first steps unchecked
calls land in aggregate rows (the ops table does not grow with the run's length)."""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
from torch import nn

import tpudiag
from tpudiag.collectors.numerics import sampling
from tpudiag.collectors.numerics.mode import NumericsMode
from tpudiag.collectors.numerics.sampling import Sampler, SamplingOptions
from tpudiag.store import Store

LAYERS = 4
BUDGET = 1e6  # percent: so much that no step is refused for time, on any machine (at 100 the first steps taken
# depended on how fast they ran: a slow first capture in a process watched more of them, one row per call)


def _loop(db: Path, steps: int) -> str:
    """A small training loop, every periodic step re-checked (a budget no step exceeds); the run's id."""
    torch.manual_seed(0)
    mods: list[nn.Module] = []
    for _ in range(LAYERS):
        mods += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 16)
    with tpudiag.capture(db=db, name="check-time", collect="numerics", budget=BUDGET) as run:
        for _ in range(steps):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    return run.id


def _ops(db: Path, run_id: str) -> list[tuple[Any, ...]]:
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(
            "SELECT op, phase, skip_reason, coalesce(calls, 1), checked FROM ops WHERE run_id = ?", [run_id]
        ).fetchall()
    finally:
        con.close()


def _settings(db: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(next(Store(db).runs_dir.rglob("numerics/settings.json")).read_text())
    return data


def test_a_step_whose_check_time_ran_out_only_counts_its_later_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampling, "CHECK_STEP_S", 0.0)  # every settled step's time is up at its first call
    looked: collections.Counter[bool] = collections.Counter()  # calls the mode looked at: in a capped step or not
    unchecked = NumericsMode._unchecked

    def spy(self: NumericsMode, *args: Any, **kwargs: Any) -> None:
        looked[self.sampler.check_until is not None] += 1
        unchecked(self, *args, **kwargs)

    monkeypatch.setattr(NumericsMode, "_unchecked", spy)
    db = tmp_path / "s.duckdb"
    steps = 300
    run_id = _loop(db, steps)
    assert looked[False] > 0  # the first steps, looked at call by call
    assert looked[True] == 0, looked  # no call of a settled step after its time ran out
    ran_out = _settings(db)["steps"]["check_time_ran_out"]
    assert ran_out >= 3, ran_out  # the periodic steps 50, 100, ... (each re-checked under --budget 100)
    rows = _ops(db, run_id)
    # Every call is still counted once: the model's linear layers' forwards, checked or not.
    assert sum(r[3] for r in rows if r[0] == "aten::addmm" and r[1] == "forward") == LAYERS * steps
    assert any(r[2] == "budget" for r in rows)


def test_past_the_first_steps_unchecked_calls_are_aggregated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Views and factories of the periodic steps land in their aggregate rows: a run twice as long writes no more
    ops rows for them (the first steps' rows, one per call, are as before)."""
    monkeypatch.setattr(sampling, "CHECK_STEP_S", 3600.0)  # no step runs out of check time: every call looked at
    short_db, long_db = tmp_path / "short.duckdb", tmp_path / "long.duckdb"
    short = _ops(short_db, _loop(short_db, 160))
    long = _ops(long_db, _loop(long_db, 320))

    def views(rows: list[tuple[Any, ...]]) -> tuple[int, int]:
        picked = [r for r in rows if r[2] == "view"]
        return len(picked), sum(r[3] for r in picked)

    (short_rows, short_calls), (long_rows, long_calls) = views(short), views(long)
    assert long_calls > short_calls  # the longer run's periodic steps saw more views ...
    assert long_rows == short_rows, (short_rows, long_rows)  # ... in the same rows


def test_a_recheck_round_goes_on_after_a_step_whose_time_ran_out() -> None:
    s = Sampler(SamplingOptions(first_k=1))
    sigs = [("aten::op", i) for i in range(6)]
    for sig in sigs:
        assert s.wants(sig)

    def periodic(reached: int) -> list[int]:
        """A re-check step whose check time runs out after it has looked at ``reached`` calls."""
        s.begin_step(boost=False, recheck=True, capped=True, now=time.perf_counter())
        done = [i for i, sig in enumerate(sigs[:reached]) if s.wants(sig)]
        s.ran_out()
        return done

    assert periodic(2) == [0, 1]
    assert periodic(4) == [2, 3]  # on past the signatures re-checked already
    assert periodic(4) == []  # nothing new within reach: the round ends ...
    assert periodic(3) == [0, 1, 2]  # ... and the next begins from the first
    for rest in ([3, 4, 5], [0, 1, 2, 3, 4, 5]):  # steps that run to their end: the round's rest, then a new round
        s.begin_step(boost=False, recheck=True, capped=True, now=time.perf_counter())
        assert [i for i, sig in enumerate(sigs) if s.wants(sig)] == rest
