"""Python's full garbage collections, run as a trace window closes (issue 21, ``tpudiag/longrun/collection.py``).

A capture's start up leaves CPython a debt of objects promoted to its oldest generation; it came due a minute or two
into a steady loop as a 0.2 s full collection in tpudiag's pulse thread or a numerics re-check (the script's thread
waiting on the GIL), outside any window.  The first window's close now runs it, where the loop already waits.  The
scripts below record every full collection (``gc.callbacks``) with the step it came in.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest

from tests.conftest import run_tpudiag
from tpudiag.longrun import collection

LOOP = """
import gc, json, sys
import torch
if "--no-gc" in sys.argv:
    gc.disable()
step = 0
full = []
def watch(phase, info):
    if phase == "stop" and info["generation"] == 2:
        full.append(step)
gc.callbacks.append(watch)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(40):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
gc.callbacks.remove(watch)
with open("full.json", "w") as fh:
    json.dump({"full": full, "enabled": gc.isenabled()}, fh)
print("loss", round(float(loss), 3))
"""


def _capture(tmp_path: Path, db: Path, *args: str) -> dict[str, object]:
    script = tmp_path / "loop.py"
    script.write_text(LOOP)
    proc = run_tpudiag("capture", "--db", str(db), "--wait", str(script), *args, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("loss "), proc.stdout
    data: dict[str, object] = json.loads((tmp_path / "full.json").read_text())
    return data


@pytest.mark.slow
def test_the_first_window_closes_with_a_full_collection(tmp_path: Path, db: Path) -> None:
    data = _capture(tmp_path, db)
    # The first window holds steps 0-19; it closes at step 20's first forward (its step boundary).
    assert 20 in data["full"], data  # type: ignore[operator]
    assert data["enabled"] is True


@pytest.mark.slow
def test_a_script_that_turned_collection_off_gets_none_of_tpudiag(tmp_path: Path, db: Path) -> None:
    data = _capture(tmp_path, db, "--no-gc")
    assert data == {"full": [], "enabled": False}


def test_settle_runs_first_then_at_most_every_so_often(monkeypatch: pytest.MonkeyPatch) -> None:
    settler = collection.Settler()
    counts: list[int] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "stop" and info["generation"] == 2:
            counts.append(2)

    gc.callbacks.append(watch)
    try:
        assert settler.settle(first=True) is not None
        assert counts == [2]
        assert settler.settle(first=False) is None  # within EVERY_S of the last one
        monkeypatch.setattr(collection, "EVERY_S", 0.0)
        settler.last_cost_s = 1.0  # a slow one: a thousand times its duration
        assert settler.settle(first=False) is None
        settler.last_cost_s = 0.0
        assert settler.settle(first=False) is not None
        assert counts == [2, 2]
        gc.disable()
        try:
            assert settler.settle(first=True) is None
        finally:
            gc.enable()
        threshold = gc.get_threshold()
        gc.set_threshold(0)  # the other way to turn automatic collection off
        try:
            assert settler.settle(first=True) is None
        finally:
            gc.set_threshold(*threshold)
        assert counts == [2, 2]
    finally:
        gc.callbacks.remove(watch)
