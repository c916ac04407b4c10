"""A running capture's spool is loaded into the store by a child process (``tpudiag/store/feeder.py``), never in the
script's own process: a real ``tpudiag capture``, a real store, real processes.

- while the script runs, its run is in the store (``tpudiag runs``) and a feeder child of the capture loads it;
- the script's process never imports DuckDB (before the feeder, the first flush loaded DuckDB and its buffers
  there: +160 MB of RSS on the long-run bench loop);
- the capture waits for the feeder before its final write: the run is stored whole, nothing of the feeder is left.
The feeder's last load when the capture is killed is covered by ``test_capture_cli``'s kill test.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import run_tpudiag

SCRIPT = """
import json, os, sys, time
import torch
m = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(m.parameters(), lr=0.1)
print("ready", flush=True)
steps = 0
deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:  # until the test has looked
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    steps += 1
    time.sleep(0.02)
print(json.dumps({"steps": steps, "duckdb_loaded": "duckdb" in sys.modules}))
"""


def _children(pid: int) -> list[str]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                out.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    return out


def test_a_child_loads_the_running_capture_and_the_script_never_loads_duckdb(tmp_path: Path, db: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    go = tmp_path / "go"
    env = {**os.environ, "TPUDIAG_FLUSH_S": "0.2"}
    env.pop("TPUDIAG_DB", None)
    cmd = [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), "--wait", str(script), str(go)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        runs: list[dict] = []
        feeders: list[str] = []
        deadline = time.monotonic() + 60
        while not (runs and feeders) and time.monotonic() < deadline:
            feeders = feeders or [c for c in _children(proc.pid) if "tpudiag.store.feeder" in c]
            out = run_tpudiag("runs", "--json", "--db", str(db), cwd=tmp_path)
            runs = json.loads(out.stdout) if out.returncode == 0 else []
            time.sleep(0.2)
        assert feeders, "no feeder child while the script ran"
        assert [r["status"] for r in runs] == ["running"], runs
    finally:
        go.touch()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["duckdb_loaded"] is False
    (run,) = json.loads(run_tpudiag("runs", "--json", "--db", str(db), cwd=tmp_path).stdout)
    assert run["status"] == "ok"
    run_dir = Path(run["artifacts_dir"])
    assert not (run_dir / "feeder.json").exists() and not (run_dir / "feeder.stop").exists()
    feeding = db.with_name(db.stem + ".runs") / ".feeding"  # readers asked it for loads while it ran (live_loads)
    assert feeding.is_dir() and not list(feeding.iterdir())
    assert not [c for c in _children(os.getpid()) if "tpudiag.store.feeder" in c]
    report = json.loads(run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path).stdout)
    assert report["pulse"]["steps"] == result["steps"]  # every step stored, loaded by the feeder or at the end
