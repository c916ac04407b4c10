"""One optimizer post-hook for every collector (collectors/step_points.py, issue 21's per-step cost)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch
from torch.optim import optimizer as optimizer_module

from tests.conftest import steps_and_windows
from tpudiag import internal_errors
from tpudiag.collectors import step_points


def _opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(3, 4)).sum().backward()
    opt.step()


def test_one_hook_calls_the_callbacks_in_order_skips_a_failing_one_and_leaves_with_the_last(tmp_path: Path) -> None:
    hooks = optimizer_module._global_optimizer_post_hooks
    before = dict(hooks)
    errors = internal_errors.begin(tmp_path)
    calls: list[str] = []

    def fails(_opt: Any) -> None:
        raise ValueError("a collector's bug")

    handles = [
        step_points.add(lambda _o: calls.append("follow"), step_points.FOLLOW, "follow", main_thread_only=False),
        step_points.add(fails, step_points.PULSE, "pulse"),
        step_points.add(lambda _o: calls.append("read"), step_points.READ, "read"),
        step_points.add(lambda _o: calls.append("read 2"), step_points.READ, "read 2"),
    ]
    try:
        assert len(hooks) == len(before) + 1  # four callbacks, one torch hook
        model, opt = _opt()
        _step(model, opt)
        assert calls == ["read", "read 2", "follow"]  # by order, then as added; the failing one skipped
        assert errors.total() == 1
        # A step on another thread: only the callback that asked for every thread.
        calls.clear()
        worker = threading.Thread(target=_step, args=(model, opt))
        worker.start()
        worker.join()
        assert calls == ["follow"]
    finally:
        for handle in handles:
            handle.remove()
        internal_errors.begin(None)
    assert dict(hooks) == before  # removed with the last callback
    calls.clear()
    _step(*_opt())
    assert calls == []


def test_a_capture_registers_one_hook_and_each_steps_memory_reading_is_in_its_own_pulse_record(
    tmp_path: Path,
) -> None:
    """The memory collector's reading runs before the pulse's record (``READ``): the pulse record of a step carries
    that step's own sample, the one the memory table keeps for it."""
    import duckdb

    import tpudiag

    hooks = optimizer_module._global_optimizer_post_hooks
    before = len(hooks)
    model, opt = _opt()
    db = tmp_path / "run.duckdb"
    kept = []
    with tpudiag.capture(db=db, name="step-points", collect="trace,memory,numerics,compile"):
        for _ in range(30):
            kept.append(torch.ones(1 << 19))  # 2 MiB more resident every step: each step's reading differs
            _step(model, opt)
            opt.zero_grad()
        assert len(hooks) == before + 1
    assert len(hooks) == before
    con = duckdb.connect(str(db), read_only=True)
    pulse = dict(con.execute("SELECT step, figures FROM pulse ORDER BY step").fetchall())
    memory = dict(con.execute("SELECT step, rss_bytes FROM memory_steps ORDER BY step").fetchall())
    con.close()
    assert sorted(pulse) == list(range(30))
    read = {s: json.loads(f)["memory.rss_bytes"] for s, f in pulse.items() if f}
    assert len(read) >= 20  # the first window's steps are all read
    assert read == {s: memory[s] for s in read}
    assert len(set(read.values())) == len(read)  # (so a reading recorded a step late could not match)


class _Wrapping(torch.optim.Optimizer):
    """An optimizer that steps an inner one (ZeRO, Lookahead): the inner step's hook fires, then its own."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__(inner.param_groups, {})

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.inner.step()


def test_steps_end_at_one_optimizers_steps_until_another_steps_twice_without_it() -> None:
    """Several optimizers stepped each iteration (Muon and AdamW, a wrapper and its inner one): one step per
    iteration.  A new optimizer that replaces the leading one leads from its second step."""
    model = torch.nn.Linear(4, 2)
    a = torch.optim.SGD([model.weight], lr=0.1)
    b = torch.optim.SGD([model.bias], lr=0.1)
    ends: list[int] = []
    handle = step_points.add(lambda o: ends.append(id(o)), step_points.PULSE, "pulse")
    try:
        for _ in range(3):
            model(torch.ones(3, 4)).sum().backward()
            a.step()
            b.step()
        assert ends == [id(a)] * 3
        # Another thread's optimizer, stepping again and again, never takes the lead from the main thread's.
        other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        worker = threading.Thread(target=lambda: [other.step() for _ in range(3)])
        worker.start()
        worker.join()
        a.step()
        assert ends == [id(a)] * 4
        wrapped = _Wrapping(torch.optim.SGD(model.parameters(), lr=0.1))
        ends.clear()
        for _ in range(3):
            model(torch.ones(3, 4)).sum().backward()
            wrapped.step()  # the inner optimizer's step, then the wrapper's: a and b no longer step
        assert ends == [id(wrapped.inner)] * 2  # its first step fell inside a's step; from its second it leads
    finally:
        handle.remove()
    # A new optimizer every step, the old ones kept (ids never repeat): a step end at least every MAX_INSIDE + 1.
    handle = step_points.add(lambda o: ends.append(id(o)), step_points.PULSE, "pulse")
    try:
        ends.clear()
        kept = [torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1) for _ in range(3 * 17)]
        for opt in kept:
            opt.step()
        assert ends == [id(kept[0]), id(kept[17]), id(kept[34])]
    finally:
        handle.remove()
    # The next capture in the process learns its own leading optimizer.
    ends.clear()
    handle = step_points.add(lambda o: ends.append(id(o)), step_points.PULSE, "pulse")
    try:
        b.step()
        a.step()
        assert ends == [id(b)]
    finally:
        handle.remove()


def test_a_capture_of_two_optimizers_a_step_has_one_step_per_iteration(tmp_path: Path) -> None:
    """Muon on the matrices and AdamW on the rest, stepped one after the other: the pulse has one step per
    iteration (it had two: the second held nothing but the other optimizer's update), and the first window holds
    20 iterations."""
    import tpudiag

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    a, b = torch.optim.SGD(matrices, lr=0.01, momentum=0.9), torch.optim.AdamW(rest, lr=0.01)
    db = tmp_path / "run.duckdb"
    with tpudiag.capture(db=db, name="two-optimizers", collect="trace"):
        for _ in range(30):
            a.zero_grad()
            b.zero_grad()
            model(torch.randn(4, 8)).square().mean().backward()
            a.step()
            b.step()
    steps, windows, in_first = steps_and_windows(db)
    assert steps == list(range(30))
    assert windows[0] == ("first_steps", 0, 19), windows
    assert in_first == 40
