"""The capture's store write after the script's exit (tpudiag/deferred_store.py): the capture returns the script's
status at once, a detached child stores the run, every reader waits for it, and a run whose child is gone is
stored by the next reader instead of being lost or marked interrupted."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tpudiag
from tpudiag import deferred_store
from tpudiag.capture_options import CaptureOptions
from tpudiag.runner import Target
from tpudiag.script_capture import capture_script as capture
from tpudiag.store import Store, pending
from tpudiag.store_access import open_store

STEPS = 4
SCRIPT = f"""
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range({STEPS}):
    opt.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
print("done")
"""


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return path


def _stored(db: Path, run_id: str) -> dict[str, Any]:
    with open_store(db).reader() as con:
        (status, exit_code, notes) = con.execute(
            "SELECT status, exit_code, notes FROM runs WHERE id = ?", [run_id]
        ).fetchone()  # type: ignore[misc]
        ops = {
            (name, module)
            for name, module in con.execute(
                "SELECT name, module FROM op_summary WHERE run_id = ? AND name LIKE 'aten::%'", [run_id]
            ).fetchall()
        }
        (steps,) = con.execute("SELECT count(*) FROM steps WHERE run_id = ?", [run_id]).fetchone()  # type: ignore[misc]
    return {"status": status, "exit_code": exit_code, "notes": json.loads(notes), "ops": ops, "steps": steps}


def _latest_run_id(db: Path) -> str:
    with Store(db).reader() as con:
        row = con.execute("SELECT id FROM runs ORDER BY started_at DESC LIMIT 1").fetchone()
    assert row is not None
    return str(row[0])


def test_detached_store_write_gives_the_same_run_as_waiting_for_it(tmp_path: Path) -> None:
    script = _script(tmp_path)
    db = tmp_path / "s.duckdb"
    waited = run_tpudiag("capture", "--db", str(db), "--collect", "trace", "--wait", str(script), cwd=tmp_path)
    assert waited.returncode == 0, waited.stderr
    assert waited.stderr.strip().splitlines()[-1].endswith(f"stored in {db}")
    waited_id = _latest_run_id(db)

    detached = run_tpudiag("capture", "--db", str(db), "--collect", "trace", str(script), cwd=tmp_path)
    assert detached.returncode == 0, detached.stderr
    assert detached.stdout == waited.stdout == "done\n"
    assert "in the background" in detached.stderr.strip().splitlines()[-1]
    run_id = detached.stderr.strip().splitlines()[-1].split()[2]
    # Read at once: the reader waits for the child, then sees the whole run, the same as the one stored in-process.
    got, want = _stored(db, run_id), _stored(db, waited_id)
    assert got["status"] == "ok" and got["exit_code"] == 0
    assert got["steps"] == want["steps"] == STEPS
    assert got["ops"] == want["ops"] and {"aten::addmm", "aten::tanh"} <= {n for n, _ in got["ops"]}
    run_dir = Store(db).run_dir(run_id)
    assert not pending.is_pending(Store(db), run_id)
    assert not (run_dir / deferred_store.RUN_FILE).exists() and not (run_dir / deferred_store.LOG_FILE).exists()
    assert not (run_dir / "trace" / "deferred.json").exists() and not (run_dir / "spool").exists()


def test_a_failing_script_keeps_its_status_and_output_when_stored_later(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent(SCRIPT) + "\nraise SystemExit(3)\n")
    db = tmp_path / "s.duckdb"
    proc = run_tpudiag("capture", "--db", str(db), "--collect", "trace", str(script), cwd=tmp_path)
    assert proc.returncode == 3 and proc.stdout == "done\n"
    got = _stored(db, _latest_run_id(db))
    assert got["exit_code"] == 3 and got["steps"] == STEPS


def test_a_script_that_changes_directory_is_stored_where_the_capture_started(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    script = tmp_path / "moves.py"
    script.write_text("import os\nos.chdir('elsewhere')\n" + textwrap.dedent(SCRIPT))
    proc = run_tpudiag("capture", "--db", "rel.duckdb", "--collect", "trace", str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "elsewhere" / "rel.duckdb").exists()
    assert _stored(tmp_path / "rel.duckdb", _latest_run_id(tmp_path / "rel.duckdb"))["steps"] == STEPS


@pytest.fixture
def orphaned_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, str]:
    """A run handed off to a child that never ran (as if it died at once): marker there, nobody holding it."""

    monkeypatch.setattr(deferred_store, "_start_child", lambda *args: None)
    db = tmp_path / "s.duckdb"
    with Store(db).writer():  # a store with other runs in it (this short run is registered by its store write)
        pass
    result = capture(Target("script", str(_script(tmp_path)), ()), CaptureOptions(db=db, collect=["trace"]))
    assert result.exit_code == 0 and not result.stored
    assert pending.is_pending(Store(db), result.run_id)
    return db, result.run_id


def test_a_reader_waits_for_the_child_then_stores_a_run_whose_child_is_gone(orphaned_run: tuple[Path, str]) -> None:
    db, run_id = orphaned_run
    marker = pending.pending_dir(Store(db)) / run_id
    fd = os.open(marker, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a child at work
    try:
        reader = subprocess.Popen(
            [sys.executable, "-m", "tpudiag", "runs", "--json", "--db", str(db)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(3.0)
        assert reader.poll() is None, reader.communicate()  # waiting for the child, not reading a half-stored run
    finally:
        os.close(fd)  # the "child" dies without storing anything
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err
    (run,) = json.loads(out)
    assert run["id"] == run_id and run["status"] == "ok"  # stored by the reader, not marked interrupted
    assert _stored(db, run_id)["steps"] == STEPS
    assert not marker.exists()


def test_a_pending_run_of_a_dead_capture_is_stored_not_marked_interrupted(orphaned_run: tuple[Path, str]) -> None:
    db, run_id = orphaned_run
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    store = Store(db)
    # Registered at a flush by a capture process that is gone now, as after any detached capture.
    final, _jobs = deferred_store.read_run_file(store.run_dir(run_id))
    store.put_run(dataclasses.replace(final, status="running", exit_code=None, pid=int(dead.stdout)))
    with store.reader(settle=False) as con:
        assert con.execute("SELECT status FROM runs WHERE id = ?", [run_id]).fetchall() == [("running",)]
    assert store.recover_stale_runs() == []
    got = _stored(db, run_id)
    assert got["status"] == "ok" and got["steps"] == STEPS


def test_a_run_that_cannot_be_stored_is_one_warning_and_its_files_stay(orphaned_run: tuple[Path, str]) -> None:
    db, run_id = orphaned_run
    store = Store(db)
    (store.run_dir(run_id) / deferred_store.RUN_FILE).write_text("{not json")
    proc = run_tpudiag("runs", "--json", "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("tpudiag:")]
    assert len(warnings) == 1 and f"run {run_id} could not be stored yet" in warnings[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert pending.is_pending(store, run_id) and (store.run_dir(run_id) / deferred_store.RUN_FILE).exists()


def test_a_store_write_retried_after_its_child_died_mid_way_stores_each_row_once(
    orphaned_run: tuple[Path, str],
) -> None:
    from tpudiag.plugins import CaptureContext, run_job
    from tpudiag.spool import Spool

    db, run_id = orphaned_run
    run_dir = Store(db).run_dir(run_id)
    _run, jobs = deferred_store.read_run_file(run_dir)
    assert [j.collector for j in jobs] == ["trace"]  # the last chunk's analysis, declared in run.json
    # The child analysed the last chunk into the spool and died before it could say so.
    run_job(jobs[0], CaptureContext(run_id=run_id, run_dir=run_dir, spool=Spool(run_dir / "spool")))
    assert run_tpudiag("runs", "--db", str(db)).returncode == 0  # another process's reader runs the finish again
    got = _stored(db, run_id)
    assert got["status"] == "ok" and got["steps"] == STEPS
    with Store(db).reader() as con:
        ids = con.execute("SELECT count(*), count(DISTINCT event_id) FROM trace_events WHERE run_id = ?", [run_id])
        total, distinct = ids.fetchone()  # type: ignore[misc]
    assert total == distinct > 0
