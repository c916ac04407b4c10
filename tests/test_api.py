"""The public Python API as a user calls it: ``tpudiag.capture`` as a context manager and as a decorator, in a
fresh interpreter (a real DuckDB store, real collectors, a real training loop)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tpudiag

USER_CODE = textwrap.dedent("""
    import json, sys
    import torch
    import tpudiag
    from tpudiag.errors import UsageError

    def train(steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            opt.zero_grad()
            loss = model(torch.ones(4, 8)).pow(2).mean()
            loss.backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    facts = {}
    plain = train(3)
    with tpudiag.capture(name="first", collect="trace,numerics", numerics="all") as run:
        captured = train(3)
    facts["bitwise"] = all(torch.equal(a, b) for a, b in zip(plain, captured))
    facts["first"] = {"id": run.id, "status": run.status, "report": run.report()}

    with tpudiag.capture(name="second", collect=["trace"]) as again:
        train(2)
    facts["second"] = {"id": again.id, "status": again.status}

    error = ValueError("boom")
    try:
        with tpudiag.capture(name="fails", collect="trace") as failing:
            train(1)
            raise error
    except ValueError as caught:
        facts["same_exception"] = caught is error
    facts["fails"] = {"id": failing.id, "status": failing.status, "error": failing.error}

    with tpudiag.capture(name="outer", collect="trace") as outer:
        with tpudiag.capture(name="inner") as inner:
            train(1)
        facts["inner_while_outer"] = {"id": inner.id, "joined": inner.joined}
    facts["outer"] = {"id": outer.id, "status": outer.status}

    @tpudiag.capture
    def bare(n):
        return len(train(n))

    @tpudiag.capture(name="named_step", collect="compile")
    def named(n):
        return sum(float(p.sum()) for p in train(n))

    facts["decorated"] = [bare(1), bare(1), round(named(1), 6) == round(sum(float(p.sum()) for p in train(1)), 6)]
    try:
        tpudiag.capture(collect="nope")
    except UsageError as err:
        facts["bad_option"] = str(err)
    print(json.dumps(facts))
""")


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("api")
    (tmp / "user.py").write_text(USER_CODE)
    db = tmp / "store.duckdb"
    proc = subprocess.run(
        [sys.executable, "user.py"],
        cwd=tmp,
        env={"PATH": "/usr/bin:/bin", "TPUDIAG_DB": str(db), "HOME": str(tmp)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1]), db


def _runs(db: Path) -> dict[str, dict[str, Any]]:
    proc = run_tpudiag("runs", "--json", "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    return {r["id"]: r for r in json.loads(proc.stdout)}


def test_a_block_is_captured_and_behaves_as_without_it(session: tuple[dict[str, Any], Path]) -> None:
    facts, db = session
    assert facts["bitwise"] is True
    first = facts["first"]
    assert first["status"] == "ok"
    report = run_tpudiag("report", "--json", "--db", str(db), first["id"])
    assert first["report"] == json.loads(report.stdout)  # run.report() is `tpudiag report --json`
    assert first["report"]["slow_ops"] and first["report"]["numerics"]["coverage"]["ops_checked"] > 0
    runs = _runs(db)
    assert runs[first["id"]]["name"] == "first" and runs[first["id"]]["status"] == "ok"


def test_capturing_twice_gives_two_runs(session: tuple[dict[str, Any], Path]) -> None:
    facts, db = session
    runs = _runs(db)
    assert facts["second"]["id"] != facts["first"]["id"]
    assert runs[facts["second"]["id"]]["status"] == "ok" and runs[facts["second"]["id"]]["collectors"] == ["trace"]


def test_an_exception_propagates_unchanged_and_the_run_is_failed_with_its_error(
    session: tuple[dict[str, Any], Path],
) -> None:
    facts, db = session
    assert facts["same_exception"] is True
    assert facts["fails"]["status"] == "failed" and facts["fails"]["error"] == "ValueError: boom"
    stored = _runs(db)[facts["fails"]["id"]]
    assert stored["status"] == "failed" and stored["exit_code"] == 1
    assert "block ended with ValueError: boom" in stored["notes"]


def test_a_nested_capture_joins_the_outer_run(session: tuple[dict[str, Any], Path]) -> None:
    facts, db = session
    assert facts["inner_while_outer"] == {"id": facts["outer"]["id"], "joined": True}
    runs = _runs(db)
    assert not [r for r in runs.values() if r["name"] == "inner"]
    assert "a nested capture (inner) joined this run" in runs[facts["outer"]["id"]]["notes"]


def test_the_decorator_captures_each_call(session: tuple[dict[str, Any], Path]) -> None:
    facts, db = session
    assert facts["decorated"] == [4, 4, True]  # return values pass through
    names = sorted(r["name"] for r in _runs(db).values())
    assert names.count("bare") == 2 and names.count("named_step") == 1
    assert "unknown collector nope" in facts["bad_option"]
