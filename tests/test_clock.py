"""The clock seam: a capture's start, duration and run id, and the trace collector's chunk rotation, all come
from the injected clock, so with a FakeClock they are exact."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.conftest import REPO
from tpudiag.clock import FakeClock

DRIVER = textwrap.dedent("""
    import builtins, json, sys
    from pathlib import Path
    from tpudiag.capture_options import CaptureOptions
    from tpudiag.script_capture import capture_script as capture
    from tpudiag.clock import FakeClock
    from tpudiag.runner import Target
    from tpudiag.store import Store, queries

    clock = builtins.tpudiag_test_clock = FakeClock(start=1_700_000_000.0)
    db = Path(sys.argv[1])
    options = CaptureOptions(db=db, collect=["trace"], collector_options={"trace": "all"})  # the whole-run trace
    result = capture(Target("script", sys.argv[2], ()), options, clock=clock)
    run = queries.resolve_run(Store(db), result.run_id)
    with Store(db).reader() as r:
        steps = r.execute("SELECT count(*) FROM steps WHERE run_id = ?", [result.run_id]).fetchone()[0]
    print(json.dumps({"id": run["id"], "started_at": run["started_at"], "duration_s": run["duration_s"],
                      "chunks": sorted(p.name for p in (Path(run["artifacts_dir"]) / "trace").glob("kineto-*.json")),
                      "steps": steps, "exit": result.exit_code}))
""")

SCRIPT = textwrap.dedent("""
    import builtins, torch
    clock = builtins.tpudiag_test_clock
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(6):
        opt.zero_grad()
        model(torch.ones(2, 8)).sum().backward()
        opt.step()
        # 31 s pass after steps 1 and 3 (the chunk limit is 30 s): the trace rotates at the next forward.
        clock.advance(31.0 if step in (1, 3) else 0.25)
""")


def test_fake_clock_moves_only_when_told() -> None:
    clock = FakeClock(start=100.0)
    assert (clock.wall(), clock.monotonic()) == (100.0, 0.0)
    clock.advance(2.5)
    assert (clock.wall(), clock.monotonic()) == (102.5, 2.5)


def test_capture_times_and_trace_chunks_come_from_the_clock(tmp_path: Path) -> None:
    (tmp_path / "driver.py").write_text(DRIVER)
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "TPUDIAG_TRACE_CHUNK_S": "30"}
    proc = subprocess.run(
        [sys.executable, "driver.py", str(tmp_path / "s.duckdb"), "train.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["exit"] == 0
    assert out["started_at"] == 1_700_000_000.0
    assert out["id"].startswith("20231114-221320-")  # the run id is the clock's wall time (UTC)
    assert out["duration_s"] == 31.0 * 2 + 0.25 * 4  # exactly what the script let pass
    assert out["chunks"] == ["kineto-000.json", "kineto-001.json", "kineto-002.json"]
    assert out["steps"] == 6  # rotating never loses a step
