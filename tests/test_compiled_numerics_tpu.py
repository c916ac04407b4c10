"""``torch.compile(backend="tpu")`` under the compiled-region checker, with the real torch-tpu package, no TPU.

What runs here: torch-tpu registers its backend, Dynamo hands the graph to it through the intercepted
``call_user_compiler``, and TorchTPU's compile then fails for want of a device.  The checker must see the graph
(as backend "tpu"), count it as skipped ``backend_failed``, and leave the script's exception exactly what it is
without tpudiag.  Checking compiled TPU numerics themselves needs a TPU (marked ``device``; not run here).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, TPU_PYTHON

pytestmark = pytest.mark.skipif(not TPU_PYTHON.exists(), reason="no Python with torch-tpu (set TPUDIAG_TPU_PYTHON)")

SCRIPT = """
import json, sys, time
import torch
from torch._dynamo.utils import counters
from tpudiag.collectors.numerics.compiled.checker import CheckerContext, CompiledChecker
from tpudiag.collectors.numerics.records import Recorder
from tpudiag.collectors.numerics.sampling import Budget, SamplingOptions


def run():
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda x: torch.tanh(x) * 2, backend="tpu")
    try:
        f(torch.randn(4))
        outcome = "ok"
    except Exception as e:
        outcome = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return {"outcome": outcome, "counters": {k: dict(v) for k, v in counters.items()}}


plain = run()
seq = [0]


def next_seq():
    seq[0] += 1
    return seq[0]


checker = CompiledChecker(
    CheckerContext("r", Recorder("r", None), SamplingOptions(), Budget(None), time.perf_counter(), next_seq)
)
checker.start()
checked = run()
checked["graphs"] = [(g.info.backend, g.unverifiable) for g in checker.graphs]
checked["summary"] = checker.stop()
print("RESULT " + json.dumps({"torch_tpu": "torch_tpu" in sys.modules, "plain": plain, "checked": checked}))
"""


def _run(tmp_path: Path) -> dict:
    env = {**os.environ, "TPU_SKIP_MDS_QUERY": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [str(TPU_PYTHON), "script.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def test_tpu_backend_graph_is_seen_and_its_failure_left_unchanged(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    result = _run(tmp_path)
    plain, checked = result["plain"], result["checked"]
    assert result["torch_tpu"]
    assert plain["outcome"] != "ok"  # no TPU here: TorchTPU's compile fails (if it ever passes, check numerics)
    assert checked["outcome"] == plain["outcome"]
    assert checked["counters"] == plain["counters"]
    assert checked["graphs"] == [["tpu", "backend_failed"]]
    assert checked["summary"]["graphs"] == 1 and checked["summary"]["graph_checks"] == 0
