"""SIGTERM under the capture runs none of the script's code after the signal, as under python
(``tpudiag.termination``): no ``finally`` block, no context manager's exit; the run is stored all the same.

End to end: a real training loop captured in a subprocess, killed by SIGTERM, against the same script under plain
python.  Unit: which interrupted stacks count as tpudiag's own code (where storing the run could deadlock).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

from tests.conftest import run_tpudiag
from tpudiag import termination
from tpudiag.collectors import module_calls, step_points

TRAINING = """
    import contextlib, sys
    import torch
    from torch import nn

    @contextlib.contextmanager
    def marker(name):
        try:
            yield
        finally:
            open(name, "w").write("ran")

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 16)
    step = 0
    with marker("exit.txt"):
        try:
            while True:
                opt.zero_grad()
                loss = model(x).square().mean()
                loss.backward()
                opt.step()
                step += 1
                if step == 20:
                    print("ready", file=sys.stderr, flush=True)
        finally:
            open("finally.txt", "w").write("ran")
    """


def _killed(command: list[str], cwd: Path, after_s: float) -> tuple[int, list[str]]:
    """Start, wait for the script's "ready", SIGTERM it ``after_s`` later: its status and the marker files left."""
    for name in ("finally.txt", "exit.txt"):
        (cwd / name).unlink(missing_ok=True)
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    assert proc.stderr.readline().strip() == "ready"
    time.sleep(after_s)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=240)
    return proc.returncode, sorted(p.name for p in cwd.glob("*.txt"))


@pytest.mark.parametrize("numerics", ["sample", "all"])
def test_sigterm_runs_none_of_the_scripts_code_after_it(tmp_path: Path, db: Path, numerics: str) -> None:
    """The loop's ``finally`` and its context manager's exit never run under python; under the capture they ran
    (the capture unwound the stack to store the run).  ``--numerics all``: tpudiag's dispatch mode runs between
    most of the script's ops, so the signal mostly lands in tpudiag's code and is asked again until it lands in the
    script's."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAINING))
    code_plain, left_plain = _killed([sys.executable, str(script)], tmp_path, 1.0)
    assert code_plain == -signal.SIGTERM and left_plain == []
    command = [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), "--numerics", numerics, str(script)]
    code_ours, left_ours = _killed(command, tmp_path, 3.0)
    assert (code_ours, left_ours) == (code_plain, left_plain)
    out = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["run"]["status"] == "interrupted" and data["run"]["exit_code"] == 143
    assert data["pulse"]["steps"] >= 20  # the steps run before the signal, stored


# -- which stacks are tpudiag's own code -----------------------------------------------------------------------


class _Listener:
    roots_only = False

    def __init__(self) -> None:
        self.frames: list[FrameType] = []

    def enter(self, module: Any, args: Any, kwargs: Any) -> Any:
        self.frames.append(sys._getframe())
        return module_calls.NO_EXIT

    def exit(self, module: Any, token: Any, output: Any, failed: bool) -> None:
        pass


class _Forward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frames: list[FrameType] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.frames.append(sys._getframe())
        return x + 1


def test_a_forward_called_through_the_module_wrapper_is_the_scripts_code_its_listener_is_not() -> None:
    here = sys._getframe()
    assert not termination.busy(here, boundary=here.f_back)
    listener, model = _Listener(), _Forward()
    module_calls.add(listener)
    try:
        model(torch.ones(2))
    finally:
        module_calls.remove(listener)
    (forward,), (entered,) = model.frames, listener.frames
    # The forward's stack has the wrapper (``module_calls._call``) waiting on torch's call: a hand-off.
    assert any(f.f_code is module_calls._call.__code__ for f in _stack(forward, here))
    assert not termination.busy(forward, boundary=here)
    # The listener is called by the wrapper's own code: storing the run there could meet a lock it holds.
    assert termination.busy(entered, boundary=here)


def test_a_step_hook_and_a_compile_in_progress_are_tpudiags_own_code() -> None:
    here = sys._getframe()
    assert termination.busy(_step_hook_frame(), boundary=here)
    saved = module_calls._compiling
    module_calls._compiling = 1  # (what Dynamo's compile start callback sets)
    try:
        assert termination.busy(here, boundary=here.f_back)
    finally:
        module_calls._compiling = saved


def test_an_import_in_progress_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module's body runs under importlib's module lock, and a store in the middle would meet the half-imported
    module: the signal is asked again until the import is over."""
    (tmp_path / "half_imported.py").write_text("import sys\nFRAME = sys._getframe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    here = sys._getframe()
    import half_imported  # type: ignore[import-not-found]

    assert termination.busy(half_imported.FRAME, boundary=here)
    sys.modules.pop("half_imported", None)


def test_threadings_code_is_waited_for_only_while_it_holds_its_module_locks() -> None:
    """A script waiting in ``threading`` (a join, a queue) is interrupted there often and holds nothing the store
    needs; a thread's end holds a module lock (not reentrant) that joining the store's threads takes."""
    import threading

    frames: list[FrameType] = []
    thread = threading.Thread(target=lambda: frames.append(sys._getframe()))
    thread.start()
    thread.join()
    (frame,) = frames
    assert frame.f_back is not None and frame.f_back.f_code.co_filename == threading.__file__
    assert not termination.busy(frame)
    with threading._shutdown_locks_lock:  # type: ignore[attr-defined]
        assert termination.busy(frame)


def test_the_signal_is_asked_again_then_given_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """In tpudiag's own code the handler returns and asks again; after ``GIVE_UP_S`` it unwinds as before."""
    frame = _step_hook_frame()
    termination.reset()
    try:
        assert termination.decide(frame) == termination.LATER
        monkeypatch.setattr(termination, "GIVE_UP_S", 0.0)
        assert termination.decide(frame) == termination.UNWIND
        assert termination.decide(sys._getframe()) == termination.NOW  # (the test's own stack: nothing of ours)
    finally:
        termination.reset()


def _step_hook_frame() -> FrameType:
    """The frame of a step-end callback, called by tpudiag's optimizer hook at a real optimizer step's end."""
    frames: list[FrameType] = []
    handle = step_points.add(lambda opt: frames.append(sys._getframe()), step_points.READ, "test")
    try:
        p = nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        p.grad = torch.ones(2)
        opt.step()
    finally:
        handle.remove()
    (frame,) = frames
    return frame


def _stack(frame: FrameType | None, stop: FrameType) -> list[FrameType]:
    out = []
    while frame is not None and frame is not stop:
        out.append(frame)
        frame = frame.f_back
    return out


RANKS = """
    import os, sys, time
    rank = int(os.environ["RANK"])
    if rank == 1:
        time.sleep(4)
        raise SystemExit("rank 1 fails")
    try:
        while True:
            sum(range(1000))
    finally:
        open(f"finally-{rank}.txt", "w").write("ran")
    """


def test_a_torchrun_rank_stopped_by_its_agent_runs_none_of_its_code_after_the_signal(tmp_path: Path, db: Path) -> None:
    """torchrun's agent stops the other ranks of a failed job with SIGTERM: under the capture a rank's ``finally``
    ran there (its stack unwound to store the rank) where python's does not."""
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(RANKS))
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    plain = subprocess.run([sys.executable, *torchrun], cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert plain.returncode != 0 and not (tmp_path / "finally-0.txt").exists(), plain.stderr[-2000:]
    ours = run_tpudiag("capture", "--db", str(db), *torchrun, cwd=tmp_path, timeout=240)
    assert ours.returncode == plain.returncode, ours.stderr[-2000:]
    assert not (tmp_path / "finally-0.txt").exists(), ours.stderr[-2000:]
    out = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["run"]["status"] in ("failed", "interrupted"), data["run"]
