"""One optimizer post-hook for every collector (collectors/step_points.py, issue 21's per-step cost)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import torch
from torch.optim import optimizer as optimizer_module

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
