"""The capture's background children (the window analyst, the store feeder) start with the capture and import
what their work needs while the script starts, at the script's priority; the script's first step puts them in the
idle class (``tpudiag.processes.early_start``, issue 21).  In the idle class from their first instruction they had
done those imports in ~4 ms slices for minutes on a core the script kept busy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tpudiag import processes

IDLE = getattr(os, "SCHED_IDLE", None)


@pytest.mark.skipif(IDLE is None, reason="no idle scheduling class on this system")
def test_an_early_child_keeps_the_scripts_priority_until_the_first_step() -> None:
    sleeper = [sys.executable, "-S", "-c", "import time; time.sleep(60)"]
    child = subprocess.Popen(sleeper, process_group=processes.BACKGROUND_GROUP)
    gone = subprocess.Popen([sys.executable, "-S", "-c", "pass"], process_group=processes.BACKGROUND_GROUP)
    gone.wait()
    try:
        processes.early_start(child)
        processes.early_start(gone)  # one that left before the first step: nothing to lower, no error
        assert processes.early_pending()
        assert os.sched_getscheduler(child.pid) == os.sched_getscheduler(0) != IDLE
        processes.end_early_start()
        assert os.sched_getscheduler(child.pid) == IDLE
        assert not processes.early_pending() and os.sched_getscheduler(0) != IDLE
    finally:
        child.kill()
        child.wait()


# A script under capture: at its first line, the children the capture started (by their command lines); how long
# until each has loaded its heaviest library (pyarrow's for the analyst, DuckDB's for the feeder: mapped into the
# process) while no step has run, whether the feeder had touched the store by then; after a few steps, whether any
# child is still at the script's priority.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from tpudiag import processes
    from tests.capture_children import children

    def loaded(pid, lib):
        with open(f"/proc/{pid}/maps") as fh:
            return lib in fh.read()

    found = children()
    kids = {name: pid for name, (pid, _) in found.items()}
    argvs = {name: argv for name, (_, argv) in found.items()}
    libs = {"analyst": "libarrow", "feeder": "duckdb"}
    t0, ready = time.monotonic(), {}
    while len(ready) < len(kids) and time.monotonic() < t0 + 60:
        for name, pid in kids.items():
            if name not in ready and loaded(pid, libs[name]):
                ready[name] = round(time.monotonic() - t0, 3)
        time.sleep(0.02)
    run_dir = argvs["feeder"][argvs["feeder"].index("tpudiag.store.feeder") + 2]  # (DB, RUN_DIR, ...)
    registered = os.path.exists(os.path.join(run_dir, "feeder.json"))
    early = processes.early_pending()

    import torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):
        opt.zero_grad(); model(torch.randn(4, 8)).sum().backward(); opt.step()
    idle = {name: os.sched_getscheduler(pid) == os.SCHED_IDLE for name, pid in kids.items()}
    print(json.dumps({"kids": sorted(kids), "ready": ready, "registered": registered, "early": early,
                      "still_early": processes.early_pending(), "idle": idle}))
    """
)


@pytest.mark.skipif(IDLE is None, reason="no idle scheduling class on this system")
def test_the_children_import_before_the_scripts_steps_and_go_idle_at_its_first_step(tmp_path: Path) -> None:
    script = tmp_path / "early.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "TPUDIAG_FLUSH_S": "120"}
    t = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "tpudiag", "capture", "--db", str(tmp_path / "t.duckdb"), "--collect", "trace",
         str(script)], capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert seen["kids"] == ["analyst", "feeder"]  # both running at the script's first line (before: at the
    # first window's end and at the first flush)
    assert set(seen["ready"]) == {"analyst", "feeder"}, seen  # their libraries loaded with no step run yet
    assert not seen["registered"]  # the feeder waits for the first flush before it touches the store
    assert seen["still_early"] is False and seen["idle"] == {"analyst": True, "feeder": True}, seen
    assert time.monotonic() - t < 200


def _ours(tmp_path: Path) -> list[str]:
    """Processes still running whose command line names this test's folder (the children pass their run's paths)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline") as fh:
                argv = fh.read().split("\0")
        except OSError:
            continue
        if any(str(tmp_path) in a for a in argv) and any(a.startswith("tpudiag.") for a in argv):
            found.append(" ".join(argv))
    return found


def test_a_script_that_ends_before_its_first_flush_leaves_no_child_behind(tmp_path: Path) -> None:
    """Started early, a child that was never handed work is not waited for at the end (a short script's exit): it
    is stopped at once, mid-import or not, and the run is stored as before."""
    script = tmp_path / "short.py"
    script.write_text("import torch\nprint(torch.ones(3).sum().item())\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    db = tmp_path / "s.duckdb"
    out = subprocess.run(
        [sys.executable, "-m", "tpudiag", "capture", "--wait", "--db", str(db), str(script)],
        capture_output=True, text=True, env=env, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0 and "3.0" in out.stdout, out.stderr[-2000:]
    assert _ours(tmp_path) == []
    from tpudiag.store import Store
    from tpudiag.store.queries import list_runs

    assert [r["status"] for r in list_runs(Store(db))] == ["ok"]
