"""Capture with the real torch-tpu 0.2.0 package installed, on a machine without a TPU.

Runs a second interpreter that has torch-tpu (``TPUDIAG_TPU_PYTHON``, default /tmp/tpuvenv/bin/python; `.ci/run`
builds one): once torch-tpu is installed, `import torch` auto-loads it, so it never goes into the main environment.
What is checked here is real: the package's own eager-mode and precision APIs, and that nothing hangs or aborts
without a TPU runtime. What needs a TPU (device traces, device numerics) cannot run here.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, REPO, TPU_PYTHON

pytestmark = pytest.mark.skipif(not TPU_PYTHON.exists(), reason="no Python with torch-tpu (set TPUDIAG_TPU_PYTHON)")


# Run inside the capture: sets a non-default TorchTPU precision, says what torch_tpu's own API reports in this
# interpreter, then trains the bundled example (1 epoch x 2 batches).
SCRIPT = """
import json, runpy, sys, warnings
import torch
import torch_tpu
from torch_tpu._internal.precision import precision_impl

warnings.simplefilter("ignore")
precision_impl._set_global_precision(precision_impl.HIGHEST)
api = {"eager": str(torch.tpu.eager_mode), "precision": str(precision_impl._get_global_precision())}
print("TPU_API " + json.dumps({**api, "torch_tpu": torch_tpu.__file__}))
sys.argv = [sys.argv[1], "--epochs", "1", "--batches", "2"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
LINEAR_LAYERS = 5  # examples/train_mlp.py: embed, 3 blocks' fc, head


def _tpu(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(TPU_PYTHON), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_capture_records_torchtpu_precision_and_eager_mode_without_hanging(tmp_path: Path) -> None:
    db = tmp_path / "tpu.duckdb"
    # tpudiag from this source tree (the main environment's editable-install hook is not seen by that interpreter).
    env = {**os.environ, "TPU_SKIP_MDS_QUERY": "1", "PYTHONPATH": str(REPO)}
    env.pop("TPUDIAG_DB", None)
    (tmp_path / "tpu_script.py").write_text(SCRIPT)
    script = str(EXAMPLES / "train_mlp.py")
    out = _tpu("-m", "tpudiag", "capture", "--db", str(db), "--collect", "trace", "tpu_script.py", script,
               cwd=tmp_path, env=env)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    api = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("TPU_API "))[8:])
    assert "torch_tpu" in api["torch_tpu"]  # torch-tpu really is loaded in that interpreter
    assert "epoch 0: loss" in out.stdout
    rep = _tpu("-m", "tpudiag", "report", "--db", str(db), "--json", "--top", "1000", cwd=tmp_path, env=env)
    assert rep.returncode == 0, rep.stderr[-2000:]
    data = json.loads(rep.stdout)
    run = data["run"]
    assert (run["status"], run["exit_code"]) == ("ok", 0)
    # What the run records is what torch_tpu's API said in the captured interpreter (precision set by the script).
    assert run["precision"]["tpu_eager_mode"] == api["eager"]
    assert run["precision"]["tpu_precision"] == api["precision"] == "Precision.HIGHEST"
    assert run["device"] == "cpu"  # no TPU here: the run says so instead of guessing
    assert run["env"].get("TPU_SKIP_MDS_QUERY") == "1"
    # The trace is real: every Linear layer's forward addmm, once per batch.
    addmm = {o["module"]: o["calls"] for o in data["slow_ops"] if o["name"] == "aten::addmm"}
    assert addmm == {m: 1 * 2 for m in ("embed", "blocks.0.fc", "blocks.1.fc", "blocks.2.fc", "head")}
    assert sum(addmm.values()) == 1 * 2 * LINEAR_LAYERS
    assert data["steps"]["count"] == 2 and data["steps"]["kind"] == "optimizer"
