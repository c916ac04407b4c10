"""Children forked from a captured script run as without tpudiag (``tpudiag/forks.py``): DataLoader workers,
multiprocessing's fork, a script's own ``os.fork()``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import duckdb

from tests.conftest import run_tpudiag, script_env, steps_and_windows, without_tpudiag_lines

# A DataLoader whose dataset calls a module (torchvision's v2 transforms are modules), two forked workers, a fresh
# pair every epoch.
DATALOADER = """
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)


class Normalize(nn.Module):
    def forward(self, x):
        return (x - x.mean()) / (x.std() + 1e-5)


class Data(Dataset):
    def __init__(self):
        self.x, self.y, self.transform = torch.randn(256, 16), torch.randint(0, 4, (256,)), Normalize()

    def __len__(self):
        return 256

    def __getitem__(self, i):
        return self.transform(self.x[i]), self.y[i]


model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
loader = DataLoader(Data(), batch_size=8, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(1))
for epoch in range(3):
    total = 0.0
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        total += loss.item()
    print(epoch, f"{total:.6f}")
"""


def test_dataloader_workers_calling_modules_make_no_steps_and_no_windows(tmp_path: Path) -> None:
    """Each worker inherited the capture: its dataset's module calls made steps, a worker's "slow step" opened a
    trace window there, and the worker's trace export took the parent's file name (the run's first window stored 0
    events, and a window of a worker's steps was stored as the run's)."""
    script = tmp_path / "loader.py"
    script.write_text(DATALOADER)
    env = script_env(tmp_path, "loader")
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    db = tmp_path / "run.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--wait", str(script), env=env, cwd=tmp_path)
    assert captured.returncode == plain.returncode == 0, captured.stderr
    assert captured.stdout == plain.stdout
    assert without_tpudiag_lines(captured.stderr) == without_tpudiag_lines(plain.stderr)
    steps, windows, first_window_steps = steps_and_windows(db)
    assert steps == list(range(3 * 32))  # one per optimizer step, the workers' none
    assert windows[0] == ("first_steps", 0, 19), windows
    assert all(last is None or last < len(steps) for _, _, last in windows), windows
    assert first_window_steps == 20
    assert "6 child process(es) forked from the script" in captured.stderr  # the run's note


# What a forked child sees of tpudiag, printed as JSON: plain Python's child sees the same.
CHILD_STATE = """
import json, os, signal, sys
import torch
import torch.optim.optimizer as optimizer_module
from torch import nn

torch.manual_seed(0)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range({steps}):
    opt.zero_grad()
    model(torch.randn(4, 8)).sum().backward()
    if step == {fork_at}:  # in the first step's backward-to-update gap (a watched numerics step)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            state = {{
                "dispatch_modes": torch._C._len_torch_dispatch_stack(),
                "module_call": nn.Module.__call__.__module__,
                "linear_call": "__call__" in nn.Linear.__dict__,
                "optimizer_post_hooks": len(optimizer_module._global_optimizer_post_hooks),
                "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            }}
            model(torch.randn(4, 8)).sum().backward()  # work the capture must not see
            os.write(write, json.dumps(state).encode())
            os._exit(0)
        os.close(write)
        print(os.read(read, 4096).decode())
        os.waitpid(pid, 0)
    opt.step()
print("done", sum(p.sum().item() for p in model.parameters()))
"""


def test_a_forked_child_sees_no_wrapper_no_hook_no_mode_and_no_handler(tmp_path: Path) -> None:
    """Forked in a watched step, the child had the numerics mode on its dispatch stack (its ops checked, recorded in
    a copy of the run's state), the module wrapper, the optimizer hook and tpudiag's SIGTERM handler."""
    script = tmp_path / "child_state.py"
    script.write_text(CHILD_STATE.format(steps=6, fork_at=0))
    env = script_env(tmp_path, "child")
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    captured = run_tpudiag("capture", "--db", str(tmp_path / "run.duckdb"), str(script), env=env, cwd=tmp_path)
    assert captured.returncode == plain.returncode == 0, captured.stderr
    assert captured.stdout == plain.stdout
    state = json.loads(captured.stdout.splitlines()[0])
    assert state == {
        "dispatch_modes": 0,
        "module_call": "torch.nn.modules.module",
        "linear_call": False,
        "optimizer_post_hooks": 0,
        "sigterm_default": True,
    }


OS_FORK = """
import os, sys
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)


def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()


train(30)  # the first trace window has closed: Kineto's threads ran in this process
pid = os.fork()
if pid == 0:
    train(30)
    print("child done", flush=True)
    sys.exit(3)  # through exit(): Python's finalisation and the native exit handlers
_, status = os.waitpid(pid, 0)
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_a_forked_child_that_runs_on_to_the_scripts_end_exits_as_plain_and_stores_nothing(tmp_path: Path) -> None:
    """The child finished the capture as the run (its exit status stored as the run's), then hung in Kineto's exit
    handler (a condition variable the parent's thread held), and the parent waited on it until killed."""
    script = tmp_path / "os_fork.py"
    script.write_text(textwrap.dedent(OS_FORK))
    env = script_env(tmp_path, "fork")
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    db = tmp_path / "run.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--wait", str(script), env=env, cwd=tmp_path, timeout=120)
    assert plain.stdout == "child done\nchild exit 3\n"
    assert captured.returncode == plain.returncode == 0, captured.stderr
    assert captured.stdout == plain.stdout
    assert captured.stderr.count("stored in") == 1, captured.stderr  # one closing line: the parent's
    con = duckdb.connect(str(db), read_only=True)
    runs = con.execute("SELECT status, exit_code FROM runs").fetchall()
    steps = con.execute("SELECT count(*) FROM pulse").fetchone()
    con.close()
    assert runs == [("ok", 0)]
    assert steps == (30,)  # the parent's steps only


def test_a_child_forked_inside_a_python_api_block_leaves_it_without_storing(tmp_path: Path) -> None:
    """``tpudiag.capture()`` in a notebook or a script: a child forked inside the block that leaves the block stores
    nothing (its exit is the block's end there); the parent's run is stored once, with the parent's steps."""
    import os

    import torch

    import tpudiag

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    db = tmp_path / "run.duckdb"
    read, write = os.pipe()
    with tpudiag.capture(db=db, name="api-fork", collect="trace") as run:
        for step in range(25):
            opt.zero_grad()
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
            if step == 5:
                pid = os.fork()
                if pid == 0:  # the child: on with the block's work, then out of the block
                    os.close(read)
                    break
    if pid == 0:
        os.write(write, f"{run.status} {run.record is not None and run.record.status}".encode())
        os._exit(0)
    os.close(write)
    child_saw = os.read(read, 4096).decode()
    os.waitpid(pid, 0)
    assert child_saw == "running running"  # the record as it began: nothing stored from the child
    assert run.record is not None and run.record.status == "ok"
    con = duckdb.connect(str(db), read_only=True)
    runs = con.execute("SELECT name, status FROM runs").fetchall()
    steps = con.execute("SELECT count(*) FROM pulse").fetchone()
    con.close()
    assert runs == [("api-fork", "ok")]
    assert steps == (25,)
