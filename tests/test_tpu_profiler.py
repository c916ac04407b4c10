"""TPU tracing in capture (collectors/tpu_profiler.py) against the real torch-tpu package, without a TPU.

These tests run a second interpreter that has torch-tpu 0.2.0 installed (``TPUDIAG_TPU_PYTHON``, default
/tmp/tpuvenv/bin/python: a venv with torch==2.13.0 and torch-tpu==0.2.0, which `import torch` auto-loads), and
SKIP when no such interpreter exists.  What runs without a TPU is checked for real: detection never hangs or
raises and reports no TPU, the capture gets a note, TorchTPU's own profiler writes a host-only XSpace (CPU
activity) beside a running Kineto session, and that XSpace's events reach the spool with the XPlane reader.
Recording the device plane itself needs a TPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, TPU_PYTHON
from tpudiag.traces import xplane_proto as xp

pytestmark = pytest.mark.skipif(not TPU_PYTHON.exists(), reason="no Python with torch-tpu (set TPUDIAG_TPU_PYTHON)")

SCRIPT = r"""
import json, os, sys, time
from pathlib import Path
from tpudiag.collectors import tpu_profiler as tp
env = {}
tp.prepare_environment(env)
had_env = os.environ.get("TPU_SKIP_MDS_QUERY")
tp.prepare_environment()
import torch
out = {"env": env, "env_after": os.environ.get("TPU_SKIP_MDS_QUERY"), "had_env": had_env}
t0 = time.monotonic()
out["loaded"], out["in_use"], out["native"] = tp.torch_tpu_loaded(), tp.tpu_in_use(), tp.native_config_available()
out["detect_s"] = time.monotonic() - t0
from tpudiag.plugins import CaptureContext
from tpudiag.spool import Spool
run_dir = Path(sys.argv[1])
ctx = CaptureContext(run_id="r1", run_dir=run_dir, spool=Spool(run_dir / "spool"))
out["session_none"] = tp.session_for(ctx) is None
out["notes"] = ctx.notes
session = tp.TpuTraceSession(run_dir / "trace" / "tpu", rank=3, device=False, native=False)
out["kwargs"] = session.profile_kwargs()
kineto = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
kineto.start()
session.start()
x = torch.randn(32, 32)
for _ in range(4):
    x = torch.tanh(x @ x)
files = session.stop()
kineto.stop()
kineto.export_chrome_trace(str(run_dir / "kineto.json"))
out["kineto_events"] = sum(1 for e in json.load(open(run_dir / "kineto.json"))["traceEvents"] if e.get("ph") == "X")
out["files"] = [str(f) for f in files]
out["written"] = session.write(ctx)
out["written_again"] = session.write(ctx)
out["metadata"] = ctx.metadata
print("RESULT " + json.dumps(out))
"""


def test_without_a_tpu_torch_tpu_host_trace_is_recorded_and_loaded(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TPU_SKIP_MDS_QUERY"}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(
        [str(TPU_PYTHON), "-c", SCRIPT, str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT ") :])
    assert out["env"] == {"TPU_SKIP_MDS_QUERY": "1"} and out["had_env"] is None and out["env_after"] == "1"
    assert out["loaded"] is True and out["in_use"] is False  # torch-tpu auto-loaded, no TPU runtime
    assert out["detect_s"] < 10
    assert out["native"] is True  # torch 2.13 with TorchTPU's TpuProfilerConfig
    assert out["session_none"] is True
    assert any("no TPU is in use" in n for n in out["notes"])
    assert out["kwargs"] == {}  # the torch_tpu path adds nothing to the Kineto session
    assert out["kineto_events"] > 0  # the Kineto session beside it still records
    # TorchTPU's layout: <dir>/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/<host>_<rank>.xplane.pb
    [xspace] = [Path(f) for f in out["files"]]
    assert xspace.parent.parent.name == "profile" and xspace.name.endswith("_3.xplane.pb")
    space = xp.parse_xspace(xspace.read_bytes())
    expected = sum(len(line.events) for plane in space.planes for line in plane.lines)
    assert expected > 0
    assert out["written"] == expected and out["written_again"] == 0
    assert out["metadata"]["tpu_trace_files"] == [str(xspace)]
    parts = sorted((tmp_path / "run" / "spool" / "trace_events").glob("*.parquet"))
    table = pq.read_table(parts)
    assert table.num_rows == expected
    assert set(table.column("run_id").to_pylist()) == {"r1"} and set(table.column("rank").to_pylist()) == {3}
    assert set(table.column("source").to_pylist()) == {"xplane"}
