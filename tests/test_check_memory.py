"""A check's memory past the run's first steps (issue 21: peak RSS over the plain script bounded).  The first
steps check every op up to the size cap as before; past them a call whose float64 check would hold more than the
allowance (``collectors/numerics/check_memory.py``) is skipped as ``size_cap``, and every smaller call is checked
with the same verdicts as without the allowance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch
from torch import nn

import tpudiag
from tpudiag.collectors.numerics import check_memory, sampling
from tpudiag.collectors.numerics.mode import Context, NumericsMode
from tpudiag.collectors.numerics.records import Recorder
from tpudiag.collectors.numerics.sampling import SamplingOptions

BIG = 300_000  # elements: its exp's check holds 8 x (1 + 3) x BIG = 9.6 MB
ALLOWANCE = 4 << 20  # between the big exp's check and every other op's


def _checked(cap: int | None) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """(op, checked, skip_reason) of each call, and (op, verdict, scaled error) of each output, with this cap."""
    torch.manual_seed(0)
    x, big = torch.randn(64, 64), torch.randn(BIG)
    recorder = Recorder("t", None)
    mode = NumericsMode(Context(run_id="t"), SamplingOptions(mode="sample"), recorder)
    mode.sampler.memory_cap = cap
    with mode:
        torch.tanh(x @ x).sum()
        torch.exp(big)
    ops, diffs = recorder.drain(final=True)
    name = {o.seq: o.op for o in ops}
    return (
        [(o.op, o.checked, o.skip_reason) for o in ops],
        [(name[d.seq], d.verdict, d.scaled_error) for d in diffs if d.verdict != "skip"],
    )


def test_a_call_over_the_allowance_is_skipped_and_smaller_calls_keep_their_verdicts(faulty_tanh: None) -> None:
    free_calls, free_verdicts = _checked(None)
    capped_calls, capped_verdicts = _checked(ALLOWANCE)
    assert ("aten::exp", True, None) in free_calls
    assert ("aten::exp", False, "size_cap") in capped_calls
    # Every other call as without the allowance, the divergent tanh included.
    assert [c for c in capped_calls if c[0] != "aten::exp"] == [c for c in free_calls if c[0] != "aten::exp"]
    assert capped_verdicts == [v for v in free_verdicts if v[0] != "aten::exp"]
    assert any(v[0] == "aten::tanh" and v[1] == "fail" for v in capped_verdicts)


def test_the_estimate_counts_inputs_once_and_outputs_three_times() -> None:
    a, b = torch.zeros(10), torch.zeros(10)
    assert check_memory.estimate([a, b], torch.zeros(10)) == 8 * (20 + 30)
    assert check_memory.estimate([a], (torch.zeros(4), torch.zeros(4, dtype=torch.long))) == 8 * (10 + 24)
    assert check_memory.allowance() >= check_memory.MIN_BYTES


def test_the_allowance_is_set_past_the_first_steps_only_and_not_for_numerics_all() -> None:
    s = sampling.Sampler(SamplingOptions(mode="sample"))
    s.begin_step(boost=True, recheck=False, capped=False)
    assert s.memory_cap is None  # the run's first steps: the size cap only
    s.begin_step(boost=True, recheck=False, capped=True)
    assert s.memory_cap == s.check_allowance() >= check_memory.MIN_BYTES  # a trace window past them
    s.begin_step(boost=False, recheck=True, capped=True)
    assert s.memory_cap is not None  # a periodic re-check step
    every = sampling.Sampler(SamplingOptions(mode="all"))
    every.begin_step(boost=False, recheck=False, capped=True)
    assert every.memory_cap is None


def test_a_graphs_values_are_counted_by_their_last_use() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    n = 1000
    torch._dynamo.reset()
    torch.compile(lambda t: ((t.exp() + 1) * t).sum(), backend=backend)(torch.randn(n))
    # exp, then add (exp freed after it), then mul (add freed), then the sum: two values of n alive at most.
    assert check_memory.graph_elements(graphs[0]) == (2 * n, 3 * n + 1)
    assert check_memory.graph_estimate(n, (2 * n, 3 * n + 1), grad=False) == 8 * (3 * n + 4 * n)
    assert check_memory.graph_estimate(n, (2 * n, 3 * n + 1), grad=True) == 8 * (3 * n + 2 * (3 * n + 1))
    # A graph with symbolic sizes is not bounded (its example values' sizes are the first compile's, not the call's).
    graphs.clear()
    torch._dynamo.reset()
    torch.compile(lambda t: ((t.exp() + 1) * t).sum(), backend=backend, dynamic=True)(torch.randn(n))
    assert check_memory.graph_elements(graphs[0]) is None


def _loop(db: Path, steps: int, trigger_at: int) -> list[tuple[Any, ...]]:
    """A training loop with a large op and a compiled function of a large input, a window triggered late; its ops
    rows (op, skip reason, calls, checked)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, big = torch.randn(8, 16), torch.randn(BIG)
    compiled = torch.compile(lambda t: (t.exp() * 2).sum(), backend="eager")
    with tpudiag.capture(db=db, name="check-memory", collect="trace,numerics", budget=1e6) as run:
        for step in range(steps):
            if step == trigger_at:
                assert tpudiag.trigger(steps=2, numerics="all")
            opt.zero_grad()
            (model(x).square().mean() + torch.exp(big).mean() + compiled(big)).backward()
            opt.step()
    con = duckdb.connect(str(db), read_only=True)
    try:
        return con.execute(
            "SELECT op, skip_reason, coalesce(calls, 1), checked FROM ops WHERE run_id = ? AND phase = 'forward'",
            [run.id],
        ).fetchall()
    finally:
        con.close()


@pytest.mark.parametrize("bounded", [True, False])
def test_a_late_windows_large_op_and_graph_are_skipped_for_memory_and_the_rest_still_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bounded: bool
) -> None:
    monkeypatch.setattr(sampling, "CHECK_STEP_S", 3600.0)  # no step's check time runs out, on any machine
    if bounded:
        monkeypatch.setattr(check_memory, "MIN_BYTES", ALLOWANCE)
        monkeypatch.setattr(check_memory, "SHARE", 1 << 40)  # the allowance is MIN_BYTES whatever the RSS
    rows = _loop(tmp_path / "m.duckdb", steps=80, trigger_at=60)
    graph_checked = sum(r[2] for r in rows if r[0].startswith("compiled_graph") and r[3])
    graph_capped = sum(r[2] for r in rows if r[0].startswith("compiled_graph") and r[1] == "size_cap")
    exp_checked = sum(r[2] for r in rows if r[0] == "aten::exp" and r[3])
    exp_capped = sum(r[2] for r in rows if r[0] == "aten::exp" and r[1] == "size_cap")
    window_checked = sum(r[2] for r in rows if r[0] == "aten::addmm" and r[3])
    assert window_checked > 3 * 2, rows  # the window's steps checked the linear layers past their first calls
    # Only the calls on the large tensor (its exp, and the eager backend's exp and mul inside the graph) and the graph.
    large = ("aten::exp", "aten::mul")
    assert not [r for r in rows if r[1] == "size_cap" and r[0] not in large and not r[0].startswith("compiled")]
    if bounded:
        assert exp_checked >= 1 and graph_checked >= 1, rows  # the first steps check them as before
        assert exp_capped >= 2 and graph_capped >= 2, rows  # the window's steps skip them for memory
    else:
        assert exp_capped == 0 and exp_checked > 3, rows
        assert graph_capped == 0 and graph_checked > 3, rows


def test_a_compiled_graphs_check_is_the_checkers_work_not_the_scripts_ops(tmp_path: Path) -> None:
    """The graph checker's copies of the inputs, its replays and comparisons run with no dispatch mode: the numerics
    mode saw its input copies as the script's ``_to_copy`` and ``clone`` calls (and checked them)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: (t.exp() * 2).sum(), backend="eager")
    x = torch.randn(64)
    db = tmp_path / "c.duckdb"
    with tpudiag.capture(db=db, name="graph-check", collect="numerics", numerics="all") as run:
        for _ in range(3):
            compiled(x)
    con = duckdb.connect(str(db), read_only=True)
    try:
        ops = {
            r[0]: r[1]
            for r in con.execute(
                "SELECT op, bool_or(checked) FROM ops WHERE run_id = ? GROUP BY op", [run.id]
            ).fetchall()
        }
    finally:
        con.close()
    assert ops.get("aten::exp") and ops.get("aten::mul"), ops  # the eager backend's own ops, checked
    assert any(op.startswith("compiled_graph") and checked for op, checked in ops.items()), ops
    assert "aten::clone" not in ops and "aten::_to_copy" not in ops, ops
