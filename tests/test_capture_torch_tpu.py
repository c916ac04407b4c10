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


def test_capture_records_torchtpu_precision_and_eager_mode_without_hanging(tmp_path: Path) -> None:
    db = tmp_path / "tpu.duckdb"
    # tpudiag from this source tree (the main environment's editable-install hook is not seen by that interpreter).
    env = {**os.environ, "TPU_SKIP_MDS_QUERY": "1", "PYTHONPATH": str(REPO)}
    env.pop("TPUDIAG_DB", None)
    out = subprocess.run(
        [
            str(TPU_PYTHON),
            "-m",
            "tpudiag",
            "capture",
            "--db",
            str(db),
            "--collect",
            "trace",
            str(EXAMPLES / "train_mlp.py"),
            "--epochs",
            "1",
            "--batches",
            "2",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    probe = subprocess.run(
        [str(TPU_PYTHON), "-c", "import torch, torch_tpu; print(torch_tpu.__file__)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert probe.returncode == 0  # torch-tpu really is loaded in that interpreter
    rep = subprocess.run(
        [str(TPU_PYTHON), "-m", "tpudiag", "report", "--db", str(db), "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    run = json.loads(rep.stdout)["run"]
    assert run["precision"]["tpu_eager_mode"] == "EagerMode.DEFER_NEVER"
    assert run["precision"]["tpu_precision"].startswith("Precision.")
    assert run["device"] == "cpu"  # no TPU here: the run says so instead of guessing
    assert run["env"].get("TPU_SKIP_MDS_QUERY") == "1"
