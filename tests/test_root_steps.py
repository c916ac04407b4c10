"""Steps of a job without an optimizer step (collectors/root_steps.py): serving, generation, evaluation phases."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest
import torch

import tpudiag
from tests.conftest import steps_and_windows
from tpudiag import internal_errors
from tpudiag.collectors import module_calls, root_steps, step_points
from tpudiag.collectors.root_steps import FIRST_CALLS, LONG_STEP_MEDIANS, LONG_STEP_S, RootSteps
from tpudiag.longrun import stride
from tpudiag.store import Store

S = 1_000_000_000  # ns


def _past_first_calls(roots: RootSteps, key: int) -> None:
    """The first step's calls (warm-up forwards before a training script's first optimizer step)."""
    roots.began(key)
    assert not any(roots.begins(key, 0, 0, None) for _ in range(FIRST_CALLS - 1))


def test_without_an_optimizer_each_call_of_the_step_root_begins_the_next_step() -> None:
    roots = RootSteps()
    _past_first_calls(roots, 1)
    assert roots.begins(1, 10, 0, None)
    roots.began(1)
    assert roots.begins(1, 20, 10, None)


def test_warm_up_forwards_before_the_first_optimizer_step_stay_in_the_first_step() -> None:
    roots = RootSteps()
    roots.began(1)
    assert not any(roots.begins(1, 0, 0, None) for _ in range(FIRST_CALLS - 1))
    roots.optimizer_stepped()
    roots.began(1)
    assert not roots.begins(1, 1, 0, None)


def test_a_module_called_once_before_the_loop_does_not_hold_the_loops_steps() -> None:
    """A prompt encoder called once per request, then the decoder once per token: the decoder's calls are the steps
    (from its second call in a row), and the encoder's next call falls inside a decoder step."""
    roots = RootSteps()
    encoder, decoder = 1, 2
    _past_first_calls(roots, encoder)
    assert not roots.begins(decoder, 1, 0, None)  # one call of another module: still the encoder's step
    assert roots.begins(decoder, 2, 0, None)  # its second call in a row: a step
    roots.began(decoder)
    assert roots.begins(decoder, 3, 2, None)
    roots.began(decoder)
    assert not roots.begins(encoder, 4, 3, None)  # the next request's prompt: inside the decoder's step
    assert roots.begins(decoder, 5, 3, None)


def test_after_an_optimizer_step_only_a_step_that_outlasts_its_limit_gives_its_root_calls_steps() -> None:
    roots = RootSteps()
    roots.began(1)
    roots.optimizer_stepped()
    # Gradient accumulation, a second forward: one step.
    assert not roots.begins(1, 2 * S, 0, 0.5)
    assert not roots.begins(2, 3 * S, 0, 0.5)  # another module, twice in a row: still one step
    assert not roots.begins(2, 4 * S, 0, 0.5)
    # An evaluation between training steps: once the step has lasted LONG_STEP_S, its root calls are steps ...
    assert roots.begins(1, int(LONG_STEP_S * S), 0, 0.5)
    roots.began(1)
    assert roots.by_root and roots.begins(1, int(LONG_STEP_S * S) + 1, int(LONG_STEP_S * S), 0.5)
    # ... until the next optimizer step.
    roots.optimizer_stepped()
    roots.began(1)
    assert not roots.begins(1, 5 * S, 0, 0.5)


def test_a_root_call_inside_a_backward_is_not_seen() -> None:
    """Gradient checkpointing calls a checkpointed module again inside the backward, outside any module call: neither
    a step of a job without an optimizer nor an evaluation phase's, and it changes no state."""
    inside = [False]
    roots = RootSteps(in_backward=lambda: inside[0])
    _past_first_calls(roots, 1)
    inside[0] = True
    assert not roots.begins(1, 10, 0, None)
    assert (roots.by_root, roots.step_root, roots.last_root, roots.waiting) == (True, 1, 1, 0)
    inside[0] = False
    assert roots.begins(1, 10, 0, None)
    roots.began(1)
    roots.optimizer_stepped()
    inside[0] = True
    assert not roots.begins(1, int(LONG_STEP_S * S) * 2, 0, 0.5)  # an outlasted step's recomputed root
    assert not roots.by_root
    inside[0] = False
    assert roots.begins(1, int(LONG_STEP_S * S) * 2, 0, 0.5)


def test_the_long_step_limit_grows_with_the_median_step() -> None:
    roots = RootSteps()
    roots.optimizer_stepped()
    roots.began(1)
    median = 2 * LONG_STEP_S / LONG_STEP_MEDIANS  # steps that routinely take this long: the limit is 2x LONG_STEP_S
    assert not roots.begins(1, int(1.5 * LONG_STEP_S * S), 0, median)
    assert roots.begins(1, int(2 * LONG_STEP_S * S), 0, median)


def test_the_steps_without_an_optimizer_call_only_the_callbacks_that_asked_with_none(tmp_path: Path) -> None:
    errors = internal_errors.begin(tmp_path)
    calls: list[tuple[str, Any]] = []

    def fails(_opt: Any) -> None:
        raise ValueError("a collector's bug")

    handles = [
        step_points.add(lambda o: calls.append(("follow", o)), step_points.FOLLOW, "follow"),
        step_points.add(fails, step_points.PULSE, "pulse", by_root=True),
        step_points.add(lambda o: calls.append(("read", o)), step_points.READ, "read", by_root=True),
    ]
    try:
        step_points.end_without_optimizer()
        assert calls == [("read", None)]  # only by_root ones, in order; the failing one recorded, not raised
        assert errors.total() == 1
    finally:
        for handle in handles:
            handle.remove()
        internal_errors.begin(None)
    step_points.end_without_optimizer()
    assert calls == [("read", None)]  # removed


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def test_an_evaluation_after_training_gets_steps_and_a_window_opened_in_it_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training steps, then an evaluation of many forwards without an optimizer step.  Its forwards become steps once
    the step has outlasted its limit (here 0.3 s), so a manual window asked for inside the evaluation opens and
    closes after its steps, and the memory readings follow the same steps.  (Before: the evaluation was one step, and
    a window could neither open nor close in it.)"""
    monkeypatch.setattr(root_steps, "LONG_STEP_S", 0.3)
    monkeypatch.setattr(stride, "EVERY_S", 0.05)  # readings enough in a second of evaluation
    db = tmp_path / "run.duckdb"
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    eval_calls = 150
    with tpudiag.capture(db=db, name="eval-phase", collect="trace,memory"):
        for _ in range(120):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        with torch.no_grad():
            for i in range(eval_calls):
                model(x)
                time.sleep(0.005)
                if i == 100:
                    assert tpudiag.trigger(steps=3)
    con = duckdb.connect(str(db), read_only=True)
    steps = [r[0] for r in con.execute("SELECT step FROM pulse ORDER BY step").fetchall()]
    windows = con.execute("SELECT reason, first_step, last_step FROM trace_windows WHERE reason = 'manual'").fetchall()
    memory = dict(con.execute("SELECT step, rss_bytes FROM memory_steps").fetchall())
    figures = con.execute("SELECT step, figures FROM pulse WHERE figures IS NOT NULL").fetchall()
    first_eval = con.execute("SELECT dur_ns FROM pulse WHERE step = 120").fetchone()
    con.close()
    assert steps == list(range(len(steps)))
    # 120 training steps; the evaluation's first step lasts ~0.3 s, then each of its forwards is a step (the last
    # one recorded at the capture's end).
    eval_steps = len(steps) - 120
    assert eval_calls // 2 <= eval_steps <= eval_calls - 5, eval_steps
    assert first_eval is not None and first_eval[0] >= 0.3 * S
    assert len(windows) == 1, windows
    _, first, last = windows[0]
    assert first > 120 and last == first + 2, windows  # opened in the evaluation, closed after its 3 steps
    # The memory readings go on through the evaluation's steps, each in its own step's pulse record.
    read = {step: json.loads(f)["memory.rss_bytes"] for step, f in figures if step > 121}
    assert len(read) >= 3, read
    assert read == {step: memory[step] for step in read}


def test_a_window_open_in_a_long_inference_loop_closes(tmp_path: Path) -> None:
    """No optimizer at all: the first window closes after its steps (before: it never closed, and the profiler ran
    for the whole job)."""
    db = tmp_path / "run.duckdb"
    model = _model()
    x = torch.randn(8, 16)
    with torch.no_grad(), tpudiag.capture(db=db, name="inference", collect="trace"):
        for _ in range(300):
            model(x)
    con = duckdb.connect(str(db), read_only=True)
    steps = con.execute("SELECT count(*), max(step) FROM pulse").fetchone()
    windows = con.execute("SELECT reason, first_step, last_step FROM trace_windows ORDER BY window_id").fetchall()
    figures = con.execute("SELECT count(*) FROM pulse WHERE window_id IS NOT NULL").fetchone()
    con.close()
    # Every call a step (the first holds FIRST_CALLS), the last ended by the capture's end.
    assert steps == (300 - FIRST_CALLS + 1, 300 - FIRST_CALLS)
    assert windows[0] == ("first_steps", 0, 19), windows
    assert all(last is not None for _, _, last in windows), windows  # every window closed after its steps
    assert figures is not None and figures[0] < 100  # most steps ran outside windows (a jitter window may open)


def _decode_gpt2(tokens: int, trigger_at: int | None = None) -> Any:
    """Greedy decoding with a compiled tiny GPT-2 (built in code), one compiled call per token, no optimizer."""
    transformers = pytest.importorskip("transformers")
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    compiled = torch.compile(model, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 4))
    with torch.no_grad():
        for i in range(tokens):
            if i == trigger_at:
                assert tpudiag.trigger(steps=2)
            logits = compiled(input_ids=ids).logits
            ids = torch.cat([ids, logits[:, -1].argmax(dim=-1, keepdim=True)], dim=1)
    return ids, {k: dict(v) for k, v in counters.items()}, torch.rand(3)


@pytest.mark.slow
def test_windows_at_a_compiled_decoders_calls_change_no_graph_and_no_token(tmp_path: Path) -> None:
    """The first window closes, and a manual one opens and closes, between a compiled decoder's calls: the tokens,
    Dynamo's counters (frames, graphs, recompiles) and the RNG stream are the plain run's."""
    _decode_gpt2(3)  # transformers' first-call work, outside both compared runs
    plain = _decode_gpt2(40)
    db = tmp_path / "run.duckdb"
    with tpudiag.capture(db=db, name="decode"):
        captured = _decode_gpt2(40, trigger_at=30)
    assert torch.equal(plain[0], captured[0])
    assert plain[1] == captured[1] and torch.equal(plain[2], captured[2])
    con = duckdb.connect(str(db), read_only=True)
    windows = con.execute("SELECT reason, first_step, last_step FROM trace_windows ORDER BY window_id").fetchall()
    steps = con.execute("SELECT count(*) FROM pulse").fetchone()
    con.close()
    assert steps == (40 - FIRST_CALLS + 1,)
    assert windows[0] == ("first_steps", 0, 19)
    asked = 30 - FIRST_CALLS + 1  # asked before call 30, which begins this step
    assert [w for w in windows if w[0] == "manual"] == [("manual", asked, asked + 1)], windows


def test_a_model_called_on_another_thread_between_steps_begins_no_step(tmp_path: Path) -> None:
    """Steps are the main thread's: a worker thread's root call after a step's end neither begins the next step (its
    shapes would be the step's) nor makes its boundary; the run's notes count such calls."""
    import threading

    db = tmp_path / "run.duckdb"
    model, other = _model(), torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    with tpudiag.capture(db=db, name="threads", collect="trace") as run:
        for _ in range(40):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            worker = threading.Thread(target=lambda: other(torch.ones(5, 3)))
            worker.start()
            worker.join()
    con = duckdb.connect(str(db), read_only=True)
    shapes = con.execute("SELECT step, shapes FROM pulse ORDER BY step").fetchall()
    con.close()
    assert [s for s, _ in shapes] == list(range(40))
    assert all(v is not None and json.loads(v) == [[8, 16]] for _, v in shapes), shapes
    # The run says that those calls' ops are in neither the trace nor the numerics (torch's profiler records the
    # thread that started it).
    assert run.record is not None
    assert any(n.startswith("40 root module call(s) ran on other threads") for n in run.record.notes), run.record.notes


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class _Checkpointed(torch.nn.Module):
    """One block applied ``depth`` times under gradient checkpointing (shared weights: each recomputation in the
    backward is a root call of the same module, twice in a row and more)."""

    def __init__(self, depth: int, reentrant: bool) -> None:
        super().__init__()
        self.block, self.depth, self.reentrant = _Block(), depth, reentrant
        self.head = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for _ in range(self.depth):
            x = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_recomputations_begin_no_step(tmp_path: Path, reentrant: bool) -> None:
    """A checkpointed block's recomputations in the backward are root calls; before the first optimizer step they
    made steps (the first training step became 25: the first window closed inside its backward, and every later
    step's number was off by 24).  Each optimizer step is one step, and the first window holds 20 of them."""
    torch.manual_seed(0)
    model = _Checkpointed(depth=32, reentrant=reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(4, 16, requires_grad=reentrant), torch.randn(4, 1)
    db = tmp_path / "run.duckdb"
    with tpudiag.capture(db=db, name="checkpointed", collect="trace"):
        for _ in range(30):
            opt.zero_grad()
            (model(x) - y).square().mean().backward()
            opt.step()
        root_classes = set(module_calls._root_classes)
    # Nor is the block a root class (in class mode each of its calls in the forward would pay the wrapper's frame).
    assert root_classes == {_Checkpointed}
    steps, windows, optimizer_steps = steps_and_windows(db)
    assert steps == list(range(30))
    assert windows[0] == ("first_steps", 0, 19), windows
    assert optimizer_steps == 20


def test_a_checkpointed_root_model_ends_one_numerics_step_per_iteration(tmp_path: Path) -> None:
    """No optimizer (the update by hand), the whole model checkpointed: its recomputation in the backward is a root
    call of the numerics collector's step root, and must not end a step (before: two steps per iteration)."""
    from torch.utils.checkpoint import checkpoint

    model = _model()
    x = torch.randn(8, 16)
    db = tmp_path / "run.duckdb"
    with tpudiag.capture(db=db, name="by-hand", collect="numerics"):
        for _ in range(12):
            checkpoint(model, x, use_reentrant=False).square().mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
    settings = json.loads(next(Store(db).runs_dir.rglob("numerics/settings.json")).read_text())
    assert settings["steps"]["boundaries"] == "root_forward"
    assert settings["steps"]["total"] == 11  # the step boundaries between 12 forwards


def test_a_thread_pool_server_keeps_nothing_per_request(tmp_path: Path) -> None:
    """A model served only from a thread pool (no main-thread step ever closes the first window): the trace
    collector kept every request's root inputs for the open window, and the numerics collector made a step boundary
    at every request, each from its own thread.  Measured on such a server (4 threads, 40 s): RSS grew ~1.5 MB a
    second; after, flat.  Now neither keeps anything per request, and the run's notes count the calls."""
    from concurrent.futures import ThreadPoolExecutor

    from tpudiag import api

    model = _model().eval()

    def request(_: int) -> float:
        with torch.no_grad():
            return float(model(torch.randn(1, 16)).sum())

    db = tmp_path / "run.duckdb"
    with tpudiag.capture(db=db, name="thread-pool") as run:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(request, range(300)))
        assert api._active is not None and api._active.session is not None
        trace = next(c for c in api._active.session.active if c.name == "trace")
        held = len(trace._root_inputs)
    assert held == 0
    settings = json.loads(next(Store(db).runs_dir.rglob("numerics/settings.json")).read_text())
    assert settings["steps"]["total"] == 0, settings["steps"]
    assert run.record is not None
    assert any(n.startswith("300 root module call(s) ran on other threads") for n in run.record.notes)
