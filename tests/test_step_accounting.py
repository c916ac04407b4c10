"""Step accounting adds up: time in steps + time outside steps is the script's own duration (±2%), and
tpudiag's own time (the numerics checker, which runs inside the steps) is shown apart.

Unit tests on hand-built spans pin the arithmetic; a real capture of the bundled example with the default
collectors (trace + numerics) checks the invariant end to end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import EXAMPLES, run_tpudiag
from tpudiag.analysis.step_summary import StepSpan, summarize_steps
from tpudiag.store import Store, step_queries

MS = 1_000_000


def spans(*pairs: tuple[int, int]) -> list[StepSpan]:
    return [StepSpan(i, start * MS, dur * MS, "optimizer") for i, (start, dur) in enumerate(pairs)]


def test_outside_steps_is_the_rest_of_the_script_not_of_the_trace() -> None:
    # The trace session runs 0..1000 ms around a script of 700 ms; steps cover 100..300 and 250..600 (overlap).
    s = summarize_steps(spans((100, 200), (250, 350)), span_ns=(0, 1000 * MS), script_s=0.7)
    assert s["steps_s"] == 0.5 and s["outside_steps_s"] == pytest.approx(0.2)
    assert s["steps_s"] + s["outside_steps_s"] == pytest.approx(0.7)  # type: ignore[operator]
    # Without a measured script (an import), the rest of the trace's span is outside.
    assert summarize_steps(spans((100, 200)), span_ns=(0, 1000 * MS))["outside_steps_s"] == 0.8


def test_tpudiag_time_is_shown_apart_per_step() -> None:
    steps = spans((0, 100), (100, 40), (140, 60))
    s = summarize_steps(steps, None, script_s=0.2, tool_ns={0: 50 * MS, 1: 20 * MS, 2: 20 * MS}, tool_total_ns=95 * MS)
    assert s["tpudiag_in_steps_s"] == pytest.approx(0.09) and s["tpudiag_s"] == pytest.approx(0.095)
    assert s["steady_median_s"] == pytest.approx(0.05)  # median of 40 and 60 ms
    assert s["steady_median_without_tpudiag_s"] == pytest.approx(0.03)  # median of 20 and 40 ms
    assert "tpudiag_in_steps_s" not in summarize_steps(steps, None, script_s=0.2)


def test_summary_contract_empty_in_empty_out() -> None:
    assert summarize_steps([], None)["count"] == 0
    steps = spans((0, 10))
    before = list(steps)
    summarize_steps(steps, (0, 20 * MS), 0.02, {0: MS}, MS)
    assert steps == before


def capture_report(tmp_path: Path, *collect: str) -> dict[str, Any]:
    db = tmp_path / "store.duckdb"
    args = ["capture", "--db", str(db), *(["--collect", ",".join(collect)] if collect else [])]
    proc = run_tpudiag(*args, str(EXAMPLES / "train_mlp.py"), "--epochs", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    assert report.returncode == 0, report.stderr
    data: dict[str, Any] = json.loads(report.stdout)
    data["_db"] = db
    return data


def test_steps_and_outside_add_up_to_the_script_duration(tmp_path: Path) -> None:
    # The default collectors: numerics on, the case whose steps held the checker's time (one capture: ~20 s).
    data = capture_report(tmp_path)
    run, steps = data["run"], data["steps"]
    duration = run["duration_s"]
    assert steps["count"] >= 2 and steps["kind"] == "optimizer"
    assert steps["steps_s"] + steps["outside_steps_s"] == pytest.approx(duration, rel=0.02)
    # The steps come from the trace, the duration from the runner's clock: they must agree, the steps fitting in
    # the script and the trace's ops (its session event left out) spanning no more than the script either.
    assert steps["steps_s"] <= duration * 1.02
    span = step_queries.op_span_ns(Store(data["_db"]), run["id"])
    assert span is not None and (span[1] - span[0]) / 1e9 <= duration * 1.02
    assert "numerics" in run["collectors"]
    own = steps["tpudiag_in_steps_s"]
    assert 0 < own < steps["steps_s"] and own <= steps["tpudiag_s"] <= duration
    assert sum(s["tpudiag_s"] for s in steps["per_step"]) == pytest.approx(own, abs=1e-5)
    assert steps["steady_median_without_tpudiag_s"] <= steps["steady_median_s"]
    text = run_tpudiag("report", "--db", str(data["_db"]), cwd=tmp_path).stdout
    assert "of which tpudiag's own (numerics checker)" in text
