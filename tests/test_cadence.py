"""A running capture's periodic store work (the flusher thread's rounds, the feeder child's loads) waits longer as
the run gets older (``tpudiag.cadence``): a fixed 10 s cadence cost the feeder 1% of a core all run long."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from tests.test_session import _session
from tpudiag import cadence, session
from tpudiag.cadence import settling_interval
from tpudiag.model import Run
from tpudiag.runner import Outcome
from tpudiag.store import feeder


def test_the_wait_grows_with_the_runs_age_within_its_bounds() -> None:
    assert settling_interval(10.0, 0.0) == 10.0
    assert settling_interval(10.0, 150.0) == 10.0  # the first 200 s at the configured interval
    assert settling_interval(10.0, 400.0) == pytest.approx(20.0)
    assert settling_interval(10.0, 600.0) == cadence.LATEST_S == settling_interval(10.0, 36_000.0)
    assert settling_interval(120.0, 36_000.0) == 120.0  # a longer configured interval is kept
    assert settling_interval(0.2, 10.0) == pytest.approx(0.5)
    waits = [settling_interval(10.0, age) for age in range(0, 5000, 7)]
    assert waits == sorted(waits)


def test_the_flusher_waits_as_the_cadence_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rounds at the configured interval, then the run is "older" and the next wait is long: no third round."""
    asked: list[tuple[float, float]] = []

    def aged(base_s: float, age_s: float) -> float:
        asked.append((base_s, age_s))
        return base_s if len(asked) <= 2 else 3600.0

    monkeypatch.setattr(session, "settling_interval", aged)
    sess, _sink, calls = _session(tmp_path, defers=False, flush_s=0.05)
    sess.start()
    deadline = time.monotonic() + 30
    while calls.count("sink flush") < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.5)  # ten configured intervals
    sess.stop(Outcome(0, "ok"))
    assert calls.count("sink flush") == 2
    assert [base for base, _ in asked] == [0.05] * len(asked) and len(asked) == 3
    assert asked[0][1] < asked[1][1] < asked[2][1]  # the run's age, growing


def test_the_feeder_loads_as_the_cadence_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = Run(id="r1", name="t", status="running", started_at=0.0, artifacts_dir=str(tmp_path))
    (tmp_path / feeder.RUN_FILE).write_text(json.dumps(asdict(run)))
    loads: list[float] = []
    asked: list[tuple[float, float]] = []

    def load(*_args: Any) -> bool:
        loads.append(time.monotonic())
        return True

    def aged(base_s: float, age_s: float) -> float:
        asked.append((base_s, age_s))
        return 3600.0  # the run is old after its first load

    monkeypatch.setattr(feeder, "lower_priority", lambda nice: "none")  # (this is the test's own process)
    monkeypatch.setattr(feeder, "_load_once", load)
    monkeypatch.setattr(feeder, "unwatched_interval", aged)
    argv = [str(tmp_path / "s.duckdb"), str(tmp_path), str(tmp_path / "spool"), str(os.getppid()), "0.01"]
    worker = threading.Thread(target=feeder.main, args=(argv,))
    worker.start()
    time.sleep(1.0)  # five of the feeder's polls, a hundred configured intervals
    (tmp_path / feeder.STOP_FILE).touch()
    worker.join(timeout=30)
    assert not worker.is_alive()
    assert len(loads) == 1 and asked and asked[0][0] == 0.01
