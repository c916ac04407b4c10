"""Cost control through a real ``tpudiag capture``: the step schedule detaches the mode in steady state, and
``--budget`` keeps a script of many small ops close to its plain speed, with what was not checked on record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tpudiag
from tpudiag.store.database import Store

LAYERS = 8
# Many tiny ops per step: the worst case for a dispatch mode (its per-op Python cost dwarfs each op).
SCRIPT = f"""
import sys, time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range({LAYERS})])
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(4, 16)
steps = int(sys.argv[1])
chunks = []
for i in range(steps):
    if i % 10 == 0:
        t0 = time.perf_counter()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
    if i % 10 == 9:
        chunks.append(time.perf_counter() - t0)
# The fastest 10-step chunk of the second half: robust against a busy machine, slow if every step pays the mode.
print(f"chunk_s={{min(chunks[len(chunks) // 2:]):.6f}}")
"""


def _capture(tmp_path: Path, db: Path, steps: int, *options: str) -> tuple[float, str]:
    script = tmp_path / "small_ops.py"
    script.write_text(SCRIPT)
    proc = run_tpudiag("capture", "--db", str(db), *options, str(script), str(steps), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    chunk = next(float(line.split("=")[1]) for line in proc.stdout.splitlines() if line.startswith("chunk_s="))
    return chunk, proc.stderr


def _report(tmp_path: Path, db: Path) -> dict[str, Any]:
    rep = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    data: dict[str, Any] = json.loads(rep.stdout)
    return data


def _calls(db: Path, op: str, phase: str) -> dict[str, int]:
    """Calls of ``op`` in the latest run by outcome: 'checked' or the skip reason."""
    with Store(db).reader() as con:
        rows = con.execute(
            "SELECT CASE WHEN checked THEN 'checked' ELSE skip_reason END, sum(calls) FROM ops "
            "WHERE op = ? AND phase = ? AND run_id = (SELECT id FROM runs ORDER BY started_at DESC LIMIT 1) "
            "GROUP BY 1",
            [op, phase],
        ).fetchall()
    return {str(k): int(v) for k, v in rows}


def test_default_policy_detaches_in_steady_state_and_records_the_skipped_steps(tmp_path: Path, db: Path) -> None:
    steps = 120
    _, stderr = _capture(tmp_path, db, steps, "--collect", "numerics")
    assert "steady_state" in stderr
    data = _report(tmp_path, db)
    cov = data["numerics"]["coverage"]
    assert cov["ops_checked"] > 0
    assert cov["skipped"].get("steady_state", 0) > cov["ops_checked"]
    # Every tanh call is accounted for exactly: checked, sampled (watched steps) or steady_state (unwatched).
    tanh = _calls(db, "aten::tanh", "forward")
    assert sum(tanh.values()) == LAYERS * steps, tanh
    assert tanh.get("steady_state", 0) >= LAYERS * (steps - 10), tanh
    settings = json.loads(next(Store(db).runs_dir.rglob("numerics/settings.json")).read_text())
    watched = settings["steps"]["watched"]
    assert settings["steps"]["boundaries"] == "optimizer"
    assert 3 <= watched <= 3 + steps // 50 + 2, settings["steps"]


def test_numerics_all_watches_every_step(tmp_path: Path, db: Path) -> None:
    steps = 20
    _capture(tmp_path, db, steps, "--collect", "numerics", "--numerics", "all")
    tanh = _calls(db, "aten::tanh", "forward")
    assert tanh == {"checked": LAYERS * steps}


@pytest.mark.slow
def test_budget_keeps_a_small_op_script_near_plain_speed(tmp_path: Path, db: Path) -> None:
    steps = 200
    plain, budgeted = [], []
    stderr = ""
    for _ in range(2):  # interleaved: a busy moment hurts both alike
        plain.append(_capture(tmp_path, db, steps, "--collect", "none")[0])
        chunk, stderr = _capture(tmp_path, db, steps, "--collect", "numerics", "--numerics", "all", "--budget", "5")
        budgeted.append(chunk)
    # A mode left attached costs this script ~20x per step even when it checks nothing (dispatch of tiny ops);
    # detached, a step runs as without tpudiag (2x leaves room for a busy 2-core machine).
    assert min(budgeted) <= 2.0 * min(plain), (plain, budgeted)
    cov = _report(tmp_path, db)["numerics"]["coverage"]
    assert cov["skipped"].get("budget", 0) > 0
    # 5% of this ~0.5 s script is ~25 ms, about what one watched step of 200 tiny ops costs in dispatch alone:
    # whether a check fits depends on the machine, but an empty check list is never silent.
    if cov["ops_checked"] == 0:
        assert "none checked" in stderr, stderr
    tanh = _calls(db, "aten::tanh", "forward")
    assert sum(tanh.values()) == LAYERS * steps, tanh
    assert tanh.get("budget", 0) >= LAYERS * steps // 2, tanh


# A loop that changes its batch size after the schedule has gone steady (steps 0-2 watched, then every 50th).
RESHAPE_SCRIPT = """
import sys, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=1e-3) if sys.argv[1] == "optimizer" else None
for i in range(80):
    x = torch.randn(4 if i < 60 else 7, 16)
    if opt is None:
        with torch.no_grad():
            model(x)
    else:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
"""


@pytest.mark.parametrize("boundaries", ["optimizer", "root_forward"])
def test_new_input_shapes_on_an_unwatched_step_get_the_next_step_watched(
    tmp_path: Path, db: Path, boundaries: str
) -> None:
    script = tmp_path / "reshape.py"
    script.write_text(RESHAPE_SCRIPT)
    proc = run_tpudiag("capture", "--db", str(db), "--collect", "numerics", str(script), boundaries, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with Store(db).reader() as con:
        shapes = {
            str(s)
            for (s,) in con.execute(
                "SELECT shapes FROM ops WHERE op = 'aten::tanh' AND checked "
                "AND run_id = (SELECT id FROM runs ORDER BY started_at DESC LIMIT 1)"
            ).fetchall()
        }
    # Batch 7 first appears at step 60, which the schedule alone would not watch (steady since step 3; every 50th).
    assert shapes == {"[[4,16]]", "[[7,16]]"}, shapes
    settings = json.loads(next(Store(db).runs_dir.rglob("numerics/settings.json")).read_text())
    assert settings["steps"]["boundaries"] == boundaries
    assert settings["steps"]["rewatched_for_new_inputs"] == 1, settings["steps"]
    # Still mostly unwatched: the probe asks for one step, the schedule goes steady again after it.
    assert settings["steps"]["watched"] <= 8, settings["steps"]


# Ops big enough that one check costs a measurable fraction of a step, many steps: a budget of 20% affords some.
AFFORDABLE_SCRIPT = """
import time, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(64, 128)
t0 = time.perf_counter()
for _ in range(600):
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
print(f"loop_s={time.perf_counter() - t0:.6f}")
"""


def _loop_s(proc: Any) -> float:
    assert proc.returncode == 0, proc.stderr
    return next(float(line.split("=")[1]) for line in proc.stdout.splitlines() if line.startswith("loop_s="))


def test_budget_checks_what_it_can_afford_and_stays_near_its_share(tmp_path: Path, db: Path) -> None:
    script = tmp_path / "affordable.py"
    script.write_text(AFFORDABLE_SCRIPT)
    # --wait: each run is stored before the next starts, so no background store write shares the machine with it.
    budget_args = ("--wait", "--collect", "numerics", "--numerics", "all", "--budget", "20", str(script))
    plain, budgeted = [], []
    for _ in range(3):  # interleaved: a busy moment hurts both alike; the fastest of three of each
        plain.append(
            _loop_s(run_tpudiag("capture", "--db", str(db), "--wait", "--collect", "none", str(script), cwd=tmp_path))
        )
        budgeted.append(_loop_s(run_tpudiag("capture", "--db", str(db), *budget_args, cwd=tmp_path)))
    # Judged from outside, by the script's own clock, this only tells a working budget from a broken one: on the
    # 2-core CI machine three identical plain runs of this loop took 0.77, 1.10 and 1.41 s, so no bound near the
    # 20% asked for survives it (per-window step medians drift 1.7-3.1 ms inside one plain run).  Measured here: a
    # working budget costs 1.0-1.3x the plain loop when the machine holds still, up to 1.9x when it does not; a
    # checker left on every step (checking nothing) 7-9x; no budget 13-40x.  The 20% itself is held by the
    # collector's own accounting, asserted below.
    assert min(budgeted) <= 2.5 * min(plain), (plain, budgeted)
    cov = _report(tmp_path, db)["numerics"]["coverage"]
    # Checks were affordable (a step takes milliseconds, a check of these ops well under one): some were made,
    # on later steps too (``watched`` below), and not everything (the budget did refuse some).  ~20-30 here.
    assert cov["ops_checked"] > 10, cov
    assert cov["skipped"].get("budget", 0) > cov["ops_checked"], cov
    settings = json.loads(next(Store(db).runs_dir.rglob("numerics/settings.json")).read_text())
    budget = settings["budget"]
    # By the collector's own accounting (measured check time, dispatch and step costs), the extra time is within
    # the percentage of the script's time, with a generous margin for the first step (always watched).
    script_s = budget["elapsed_s"] - budget["spent_s"]
    assert budget["spent_s"] <= 2.0 * 0.20 * script_s, budget
    assert settings["steps"]["watched"] >= 2, settings["steps"]
