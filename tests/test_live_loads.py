"""A reader of the store asks a running capture's feeder for a load and reads the job as it is now
(``tpudiag/store/live_loads.py``); the feeder's own clock can then be slow.  A real feeder child process, a real
store, real Parquet parts; the feeder's own clock is set to an hour so that only a reader's request can load a part.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import duckdb
import pyarrow.parquet as pq

from tpudiag import cadence
from tpudiag.model import PulseStep, Run, records_to_arrow
from tpudiag.store import Store, live_loads
from tpudiag.store.feeder import RUN_FILE, STOP_FILE


def _part(spool: Path, name: str, steps: range) -> None:
    folder = spool / "pulse"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [PulseStep(run_id="r1", step=s, start_ns=s * 1000, dur_ns=900) for s in steps]
    tmp = folder / f".{name}.tmp"
    pq.write_table(records_to_arrow(PulseStep, rows), tmp)
    tmp.rename(folder / f"{name}.parquet")  # finished parts only, as the spool writes them


def _pulse_rows(db: Path) -> int:
    """Read as a user's own DuckDB client would (no request for a load)."""
    for _ in range(100):
        try:
            with duckdb.connect(str(db), read_only=True) as con:
                return int(con.execute("SELECT count(*) FROM pulse").fetchone()[0])  # type: ignore[index]
        except duckdb.IOException:  # the feeder holds it for a moment
            time.sleep(0.05)
    raise AssertionError("the store stayed locked")


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def test_a_reader_gets_what_was_spooled_since_the_feeders_last_load(tmp_path: Path) -> None:
    db, run_dir = tmp_path / "s.duckdb", tmp_path / "s.runs" / "r1"
    spool = run_dir / "spool"
    spool.mkdir(parents=True)
    run = Run(id="r1", name="job", status="running", started_at=time.time(), artifacts_dir=str(run_dir))
    (run_dir / RUN_FILE).write_text(json.dumps(asdict(run)))
    _part(spool, "a", range(0, 10))
    argv = [str(db), str(run_dir), str(spool), str(os.getpid()), "3600"]  # its own clock: an hour
    feeder = subprocess.Popen([sys.executable, "-m", "tpudiag.store.feeder", *argv], stderr=subprocess.PIPE)
    live_loads.start(Store(db).runs_dir, "r1")  # as SpoolFeeder.start does
    feeding = live_loads.folder(Store(db).runs_dir)
    try:
        _wait_for(feeding / ("r1" + live_loads.LOADED))  # its first load, at once
        assert _pulse_rows(db) == 10
        _part(spool, "b", range(10, 25))
        time.sleep(1.0)  # five of its polls: nobody asked, nothing loaded
        assert _pulse_rows(db) == 10
        old = time.time() - live_loads.FRESH_S - 1  # the first load is no longer fresh
        os.utime(feeding / ("r1" + live_loads.LOADED), (old, old))
        with Store(db).reader() as con:  # asks, waits for the load
            assert con.execute("SELECT count(*) FROM pulse").fetchone() == (25,)
        assert not (feeding / ("r1" + live_loads.WANT)).exists()
    finally:
        (run_dir / STOP_FILE).touch()
        _, err = feeder.communicate(timeout=60)
    assert feeder.returncode == 0, err


def test_a_request_nobody_serves_costs_one_wait(tmp_path: Path) -> None:
    """A run marked fed by a feeder that is gone (killed with its capture): the first reader waits once, no later
    one; the next capture's recovery of the dead run removes the mark."""
    runs = tmp_path / "s.runs"
    live_loads.start(runs, "r1")
    t0 = time.monotonic()
    assert live_loads.ask_for_fresh(runs, wait_s=1.0) == 1
    first = time.monotonic() - t0
    assert first >= 1.0
    time.sleep(live_loads.WAIT_S + 0.5 - first)  # the request is older than WAIT_S now
    t0 = time.monotonic()
    assert live_loads.ask_for_fresh(runs, wait_s=1.0) == 0
    assert time.monotonic() - t0 < first
    live_loads.stop(runs, "r1")
    assert os.listdir(live_loads.folder(runs)) == []
    assert live_loads.ask_for_fresh(tmp_path / "none") == 0  # no runs folder: nothing to ask


def test_a_load_under_fresh_s_ago_is_not_asked_again(tmp_path: Path) -> None:
    """A dashboard page's many queries ask once: a feeder that loaded under FRESH_S ago is not asked again."""
    runs = tmp_path / "s.runs"
    live_loads.start(runs, "r1")
    live_loads.mark_loaded(runs, "r1")
    loaded, want = (
        live_loads.folder(runs) / ("r1" + live_loads.LOADED),
        live_loads.folder(runs) / ("r1" + live_loads.WANT),
    )
    assert live_loads.ask_for_fresh(runs, wait_s=0.1) == 0
    assert not want.exists()
    old = time.time() - live_loads.FRESH_S - 1
    os.utime(loaded, (old, old))
    assert live_loads.ask_for_fresh(runs, wait_s=0.1) == 1
    assert want.exists()  # (no feeder here to serve it)
    live_loads.mark_loaded(runs, "r1")  # what the feeder does after its load
    assert not want.exists()
    assert live_loads.ask_for_fresh(runs, wait_s=0.1) == 0


def test_the_feeders_own_clock_slows_to_two_minutes() -> None:
    assert cadence.unwatched_interval(10.0, 0.0) == 10.0
    assert cadence.unwatched_interval(10.0, 15.0) == 10.0
    assert cadence.unwatched_interval(10.0, 100.0) == 50.0
    assert cadence.unwatched_interval(10.0, 36_000.0) == cadence.UNWATCHED_LATEST_S == 120.0
    assert cadence.unwatched_interval(600.0, 36_000.0) == 600.0  # a longer configured interval is kept
    waits = [cadence.unwatched_interval(10.0, age) for age in range(0, 5000, 7)]
    assert waits == sorted(waits)
