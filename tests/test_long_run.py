"""Long runs (issue 21), end to end through a real ``tpudiag capture``: a real profiler, a real store, a loop of
fast steps with planted anomalies (tests/long_scripts/long_loop.py).

- a 60 s loop with a run of slow steps and a recompile late in the run: windows open for them with the right
  reasons, the slow op tops its window, the pulse holds every step, RSS stays flat, the trace files stay small;
- a manual trigger from another process (``tpudiag trigger``) and from the script (``tpudiag.trigger()``);
- a numerics fault that starts late in the run is found (the checker re-checks later steps);
- a run folder that fills up (a tiny tmpfs) or becomes unwritable mid-run degrades the capture, never the script.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, run_tpudiag
from tpudiag.collectors.root_steps import FIRST_CALLS

LOOP = REPO / "tests" / "long_scripts" / "long_loop.py"
# Triggers 4 s apart at most; a slow step is 8x the median (the planted sort is ~50x on a quiet machine, ~15x on a
# busy one).
ENV = {"TPUDIAG_TRIGGER_INTERVAL_S": "4", "TPUDIAG_SLOW_FACTOR": "8"}


def _script_result(stdout: str) -> dict[str, Any]:
    line = next(line for line in reversed(stdout.splitlines()) if line.startswith("{"))
    data: dict[str, Any] = json.loads(line)
    return data


def _report(tmp_path: Path, db: Path) -> dict[str, Any]:
    rep = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    data: dict[str, Any] = json.loads(rep.stdout)
    return data


def _by_reason(windows: list[dict[str, Any]], reason: str) -> list[dict[str, Any]]:
    return [w for w in windows if w["reason"] == reason]


@pytest.mark.slow
def test_a_long_loop_keeps_a_pulse_and_opens_windows_for_its_anomalies(tmp_path: Path, db: Path) -> None:
    proc = run_tpudiag(
        "capture", "--db", str(db), "--wait", "--trace-schedule", "every=15s,active=3", "--max-disk", "300MB",
        str(LOOP), "60", "--slow-at", "25", "--recompile-at", "42", "--api-trigger-at-step", "400",
        cwd=tmp_path, env=ENV, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    script = _script_result(proc.stdout)
    assert script["api_triggered"] is True
    data = _report(tmp_path, db)
    pulse, windows = data["pulse"], data["windows"]

    # The pulse holds every step of the run, numbered as the script counted them.
    assert pulse["steps"] == script["steps"]
    assert pulse["recompiles"] >= 1
    slow_from = script["slow_from"]
    assert any(slow_from <= s["step"] < slow_from + 30 for s in pulse["slow_steps"]), pulse["slow_steps"]

    # Window 0 is the first steps; every window has a reason and an id in order.
    assert windows[0]["reason"] == "first_steps" and windows[0]["first_step"] == 0
    assert [w["id"] for w in windows] == sorted(w["id"] for w in windows)
    slow = _by_reason(windows, "slow_step")
    assert slow, [(w["reason"], w["first_step"]) for w in windows]
    # Opened during the planted run of slow steps (at its first step, unless a jitter window held the rate limit).
    planted = [w for w in slow if slow_from < w["first_step"] < slow_from + 30]
    assert planted, (slow_from, [(w["first_step"], w["detail"]) for w in slow])
    first_slow = planted[0]
    assert first_slow["top_ops"][0]["name"] == "aten::sort", first_slow["top_ops"]
    assert first_slow["numerics"] is True
    recompile = _by_reason(windows, "recompile")
    # The recompile ran after step N's optimizer step: counted in step N+1, its window opens at N+2 (later if another
    # window is open then).
    assert recompile and script["recompile_step"] + 2 <= recompile[0]["first_step"] <= script["recompile_step"] + 12
    assert "size mismatch" in recompile[0]["detail"], recompile
    assert _by_reason(windows, "schedule"), [w["reason"] for w in windows]
    manual = _by_reason(windows, "manual")
    assert manual and manual[0]["first_step"] == 401 and manual[0]["last_step"] == 403, manual
    for w in windows:
        assert w["trace_events"] > 0 and w["end_s"] > w["start_s"]

    # Bounded: RSS flat over the last two thirds of the run (medians of once-a-second readings: a window's transient
    # peak is not growth); the trace files far below the cap.
    samples = script["rss_samples"]
    middle = [kb for t, kb in samples if 20 <= t < 40]
    last = [kb for t, kb in samples if t >= 40]
    growth_mb = (statistics.median(last) - statistics.median(middle)) / 1024
    assert growth_mb < 50, [(t, kb >> 10) for t, kb in samples]
    run_dir = Path(data["run"]["artifacts_dir"])
    trace_bytes = sum(p.stat().st_size for p in (run_dir / "trace").glob("*.json"))
    assert trace_bytes < 300 << 20
    assert not (run_dir / "trace" / "jobs").exists()  # every window was analysed

    text = run_tpudiag("report", "--db", str(db), cwd=tmp_path).stdout
    assert "Timeline (pulse: every step)" in text and "slow_step" in text and "recompile" in text


def _run_folder(db: Path, timeout: float = 60) -> Path:
    runs = db.with_name(db.stem + ".runs")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [p for p in runs.glob("2*") if p.is_dir()] if runs.is_dir() else []
        if found:
            return found[0]
        time.sleep(0.1)
    raise AssertionError("no run folder appeared")


@pytest.mark.slow
def test_a_manual_trigger_from_another_process_opens_a_window(tmp_path: Path, db: Path) -> None:
    ready = tmp_path / "ready"
    cmd = [
        sys.executable,
        "-m",
        "tpudiag",
        "capture",
        "--db",
        str(db),
        "--wait",
        str(LOOP),
        "25",
        "--ready",
        str(ready),
    ]
    env = {**os.environ, **ENV}
    env.pop("TPUDIAG_DB", None)
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = _run_folder(db)
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(8)  # past the first window and the warm-up
        sent = run_tpudiag("trigger", "--db", str(db), run_dir.name, "--steps", "4", cwd=tmp_path)
        assert sent.returncode == 0, sent.stderr
        assert "trigger sent" in sent.stderr
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    windows = _report(tmp_path, db)["windows"]
    manual = _by_reason(windows, "manual")
    assert len(manual) == 1, windows
    assert manual[0]["last_step"] - manual[0]["first_step"] + 1 == 4
    assert manual[0]["detail"] == "tpudiag trigger"


def test_trigger_refuses_an_unknown_run(tmp_path: Path, db: Path) -> None:
    out = run_tpudiag("trigger", "--db", str(db), "no-such-run", cwd=tmp_path)
    assert out.returncode != 0
    assert out.stderr.count("\n") == 1 and "no-such-run" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_numerics_fault_that_starts_late_is_found(tmp_path: Path, db: Path) -> None:
    # Step 400 is long after the sampler's first calls of every signature (steps 0-3): before issue 21 every later
    # call was skipped as steady_state and this fault was never seen.
    proc = run_tpudiag(
        "capture", "--db", str(db), "--wait", str(LOOP), "45", "--fault-at-step", "400", "--width", "32",
        cwd=tmp_path, env=ENV, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "first divergence: aten::tanh" in proc.stderr, proc.stderr
    data = _report(tmp_path, db)
    from tpudiag.store.database import Store

    with Store(db).reader() as con:
        rows = con.execute(
            "SELECT DISTINCT o.op FROM op_diffs d JOIN ops o USING (run_id, seq) WHERE d.role = 'originator'"
        ).fetchall()
    # The kernel is exact until step 400: whatever divergence is found was found in a step after it.
    assert ("aten::tanh",) in rows, rows
    assert _by_reason(data["windows"], "numerics"), [w["reason"] for w in data["windows"]]


def _tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if shutil.which("mount") is None:
        return False
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return ok.returncode == 0


@pytest.mark.slow
def test_a_full_run_folder_degrades_the_capture_not_the_script(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    mounted = _tmpfs(disk, "12m")
    db = disk / "s.duckdb"
    try:
        args = ["capture", "--db", str(db), "--trace-schedule", "every=2s,active=20", str(LOOP), "25"]
        if mounted:
            proc = run_tpudiag(*args, cwd=tmp_path, env=ENV, timeout=600)
        else:  # not root: the run folder's trace and spool folders become files mid-run (unwritable)
            cmd = [sys.executable, "-m", "tpudiag", *args]
            p = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            run_dir = _run_folder(db)
            time.sleep(10)
            for name in ("trace", "spool"):
                shutil.rmtree(run_dir / name, ignore_errors=True)
                (run_dir / name).write_text("not a folder")
            out, err = p.communicate(timeout=300)
            proc = subprocess.CompletedProcess(cmd, p.returncode, out, err)
        plain = subprocess.run([sys.executable, str(LOOP), "1"], capture_output=True, text=True, timeout=120)
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert set(_script_result(proc.stdout)) == set(_script_result(plain.stdout))  # the script's output, whole
    assert "Traceback" not in proc.stderr
    degraded = [line for line in proc.stderr.splitlines() if "trace windows stopped" in line or "pulse:" in line]
    assert degraded, proc.stderr


GROWING = """
import time
import torch
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
kept = []
for step in range(200):
    loss = model(torch.randn(16, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step >= 130:
        kept.append(torch.ones(2 << 20))  # 8 MiB more held every step: a leak
        time.sleep(0.03)  # for 2 s at least: readings are 0.5 s apart on fast steps (tpudiag.longrun.stride)
print("steps", step + 1, "held", len(kept))
"""


@pytest.mark.slow
def test_memory_growth_opens_a_memory_window_and_the_pulse_carries_memory(tmp_path: Path, db: Path) -> None:
    """The memory collector's figures join every pulse record, and a leak past the post-warm-up floor opens a
    ``memory`` window (issue 21 trigger, issue 22 figures)."""
    script = tmp_path / "leak.py"
    script.write_text(GROWING)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    # No slow_step windows here: on a loaded machine the leak's allocating steps can read 8x the median, and a window
    # opened in the leak raises the memory floor to what it leaves behind (tpudiag.longrun.growth), so the
    # leak's remaining steps would not reach 1.25x before the script ends (a CI run saw exactly that).
    env = {**ENV, "TPUDIAG_SLOW_FACTOR": "1000"}
    proc = run_tpudiag("capture", "--db", str(db), "--wait", str(script), cwd=tmp_path, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain.stdout
    data = _report(tmp_path, db)
    assert not _by_reason(data["windows"], "slow_step"), data["windows"]
    memory_windows = _by_reason(data["windows"], "memory")
    assert memory_windows, data["windows"]
    assert memory_windows[0]["first_step"] > 130
    import duckdb

    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT step, figures FROM pulse ORDER BY step").fetchall()
    con.close()
    assert len(rows) == 200
    rss = {step: json.loads(f)["memory.rss_bytes"] for step, f in rows if f}
    # Every one of the first window's steps has its reading; later fast steps one per 0.5 s (tpudiag.longrun.stride),
    # the others read None, never a copied value.  How many later steps are read depends on this machine's speed.
    assert all(step in rss for step in range(20))
    later = sorted(step for step in rss if step >= 20)
    assert later and len(later) < 180 - 20, later
    last = later[-1]
    assert last > 150, later  # the window opened on a reading in the leak, and readings went on after it
    before = max(step for step in rss if step <= 130)
    assert rss[last] - rss[before] > (last - 130) * (8 << 20) * 3 // 4


SIXTY_STEPS = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(60):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("loss", round(float(loss), 3))
"""


@pytest.mark.slow
def test_compare_times_every_step_through_the_pulse(tmp_path: Path, db: Path) -> None:
    """With trace windows the trace holds only the first steps: compare's step section reads every step from the
    pulse (the steady comparison would otherwise see only the first window's steps)."""
    script = tmp_path / "sixty.py"
    script.write_text(SIXTY_STEPS)
    for name in ("a", "b"):
        proc = run_tpudiag("capture", "--db", str(db), "--wait", "--name", name, str(script), cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    out = run_tpudiag("compare", "a", "b", "--db", str(db), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    steady = json.loads(out.stdout)["steps"]["steady"]
    assert steady["n_a"] >= 50 and steady["n_b"] >= 50, steady


SERVING = REPO / "tests" / "long_scripts" / "serving_loop.py"


@pytest.mark.slow
def test_a_serving_loop_without_an_optimizer_keeps_a_pulse_and_windows(tmp_path: Path, db: Path) -> None:
    """A generation loop (a prompt encoder once per request, a decoder once per token, no optimizer anywhere) under
    the default capture: every decoder call is a step of the pulse, the first window closes after its steps, the
    schedule and a planted run of slow calls open windows of their own, memory stays flat, and the tokens are the
    plain run's.  (Before collectors/root_steps.py: no pulse, and the first window ran for the whole job.)"""
    plain = subprocess.run(
        [sys.executable, str(SERVING), "2", "--prompt-encoder"], capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    proc = run_tpudiag(
        "capture", "--db", str(db), "--wait", "--trace-schedule", "every=5s,active=3",
        str(SERVING), "24", "--slow-at", "6", "--prompt-encoder",
        cwd=tmp_path, env=ENV, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    script = _script_result(proc.stdout)
    assert script["requests"] >= 20 and script["digest"] == _script_result(plain.stdout)["digest"]
    data = _report(tmp_path, db)
    pulse, windows = data["pulse"], data["windows"]

    # One step per decoder call (the encoder's call falls inside one; the first step holds the first calls).
    assert pulse["steps"] == script["calls"] - FIRST_CALLS + 1
    assert windows[0]["reason"] == "first_steps" and (windows[0]["first_step"], windows[0]["last_step"]) == (0, 19)
    assert _by_reason(windows, "schedule"), [w["reason"] for w in windows]
    slow_from = script["slow_from"] - (FIRST_CALLS - 1)  # the script counts calls, the pulse steps
    planted = [w for w in _by_reason(windows, "slow_step") if slow_from < w["first_step"] < slow_from + 30]
    assert planted, (slow_from, [(w["reason"], w["first_step"]) for w in windows])
    assert planted[0]["top_ops"][0]["name"] == "aten::sort", planted[0]["top_ops"]
    # Windows hold a few steps each: the trace is a small part of what a whole-run trace would be.
    in_windows = sum(w["last_step"] - w["first_step"] + 1 for w in windows)
    assert in_windows < 200 < pulse["steps"] // 10, (in_windows, pulse["steps"])

    # Flat after the planted run's window (its every-op checks of 2M-element sorts leave the allocator a one-time
    # step up, not a slope): the middle and the last third of the run, both after it.
    samples = script["rss_samples"]
    middle = [kb for t, kb in samples if 10 <= t < 17]
    last = [kb for t, kb in samples if t >= 17]
    assert (statistics.median(last) - statistics.median(middle)) / 1024 < 50, [(t, kb >> 10) for t, kb in samples]
