"""The launchers users use, captured as one run with ranks: ``accelerate launch`` (console script and ``-m``), a
custom launcher on torchrun's elastic agent, TorchTPU's session id as the run id; console scripts found on PATH;
Python processes tpudiag does not reach named in the run, with how to capture them.

Real processes throughout: accelerate's own launcher with 2 CPU processes on gloo (``--multi_gpu`` is accelerate's
switch to its torchrun launcher; on a machine without GPUs the script's ``Accelerator(cpu=True)`` makes the two
processes a MULTI_CPU job), ``elastic_launch``, ``multiprocessing`` and ``subprocess`` workers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.conftest import run_plain_reference, run_tpudiag

ENV = {"OMP_NUM_THREADS": "1", "TPUDIAG_FLUSH_S": "2"}
ACCELERATE_FLAGS = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                    "--dynamo_backend", "no", "--main_process_port", "0"]  # fmt: skip

TRAIN = r"""
import sys, torch
from accelerate import Accelerator
acc = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = acc.prepare(model, opt)
data = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
for step in range(3):
    loss = model(data[step]).sum()
    acc.backward(loss)
    opt.step()
    opt.zero_grad()
    sys.stdout.write(f"rank {acc.process_index} of {acc.num_processes} step {step} loss {loss.item():.6f}\n")
acc.wait_for_everyone()  # torch 2.13's gloo aborts ~6-10% of exits without these two (plain runs too)
acc.end_training()
"""

ELASTIC_LAUNCHER = r"""
import sys, uuid
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=str(uuid.uuid4()),
                      rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
elastic_launch(config, sys.executable)("-u", "worker.py")  # the interpreter itself, not $PYTHON_EXEC
print("launcher done")
"""

WORKER = r"""
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(3) * (dist.get_rank() + 1)
dist.all_reduce(t)
sys.stdout.write(f"rank {dist.get_rank()} sum {t.sum().item()}\n")
dist.barrier()  # torch 2.13's gloo aborts ~6% of exits without it (plain runs too)
dist.destroy_process_group()
"""

MISSED = r"""
import multiprocessing as mp, subprocess, sys, torch

def work(n):
    x = torch.ones(n, n)
    print("worker", float((x @ x).sum()), flush=True)

if __name__ == "__main__":
    loader = torch.utils.data.DataLoader(torch.arange(4.0), batch_size=2, num_workers=1)
    print("batches", [b.tolist() for b in loader], flush=True)  # a DataLoader worker: not a missed process
    p = mp.get_context("spawn").Process(target=work, args=(8,))
    p.start()
    p.join()
    subprocess.run([sys.executable, "-c", "import torch; print('sub', torch.ones(2).sum().item())"], check=True)
    print("parent done", p.exitcode, flush=True)
"""


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def _report(db: Path, *extra: str) -> dict[str, Any]:
    res = run_tpudiag("report", "--db", str(db), "--json", *extra)
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def _plain(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return run_plain_reference(cmd, cwd, {**os.environ, **ENV})


def _assert_two_rank_run(db: Path) -> dict[str, Any]:
    report = _report(db)
    dist = report["distributed"]
    assert dist is not None, report["run"]["notes"]
    assert dist["world_size"] == 2 and dist["backend"] == "gloo"
    assert [(r["rank"], r["status"]) for r in dist["ranks"]] == [(0, "ok"), (1, "ok")]
    assert not any("did the script run any torch ops" in n for n in report["run"]["notes"])
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchall() == [(1,)]  # one run for every process
        ranks = con.execute("SELECT DISTINCT rank FROM trace_events ORDER BY rank").fetchall()
    assert ranks == [(0,), (1,)]  # the ranks' events are the run's (the launcher's are not)
    return report


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accelerate_launch_console_script_records_every_process(tmp_path: Path) -> None:
    _write(tmp_path, "train.py", TRAIN)
    db = tmp_path / "store.duckdb"
    args = ["launch", *ACCELERATE_FLAGS, "train.py"]
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "trace,numerics", "accelerate", *args,
                           cwd=tmp_path, env=ENV)  # fmt: skip
    plain = _plain([shutil.which("accelerate") or "accelerate", *args], tmp_path)
    assert plain.returncode == 0, plain.stderr
    assert captured.returncode == 0, captured.stderr
    assert sorted(captured.stdout.splitlines()) == sorted(plain.stdout.splitlines())
    assert "rank 1 of 2 step 2" in captured.stdout
    report = _assert_two_rank_run(db)
    assert report["run"]["script"].endswith("/accelerate")  # found on PATH, as the shell finds it
    assert all(r["steps"] == 3 for r in report["distributed"]["ranks"])
    assert report["numerics"]["coverage"]["ops_checked"] > 0  # the ranks' numerics, not the launcher's none
    assert {r["numerics_checked"] > 0 for r in report["distributed"]["ranks"]} == {True}
    assert "did the script run any torch ops" not in captured.stderr


def _plain_lines(tmp_path: Path, ranks: int) -> list[str]:
    """What ``TRAIN`` prints without tpudiag, on this machine, for each of ``ranks`` processes (sorted).

    One plain process is the reference: every rank trains on the same batches and DDP averages identical gradients,
    so each rank prints the one-process losses.  The last digits depend on the CPU's kernels (CI's machine printed
    -19.074356 at step 2, this one -19.074354), so no figure is written into the test."""
    plain = _plain([sys.executable, "train.py"], tmp_path)
    assert plain.returncode == 0, plain.stderr
    losses = [ln.split(" step ", 1)[1] for ln in plain.stdout.splitlines() if ln.startswith("rank 0 of 1 step ")]
    assert len(losses) == 3, plain.stdout
    return sorted(f"rank {r} of {ranks} step {loss}" for r in range(ranks) for loss in losses)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accelerate_launch_single_process_is_captured(tmp_path: Path) -> None:
    """``--cpu`` makes accelerate start one plain Python child (no elastic agent): that child is the run's rank."""
    _write(tmp_path, "train.py", TRAIN)
    db = tmp_path / "store.duckdb"
    flags = ["--cpu", "--num_processes", "1", *ACCELERATE_FLAGS[3:-2]]  # --num_machines 1 ... --dynamo_backend no
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "trace,numerics", "accelerate", "launch", *flags,
                           "train.py", cwd=tmp_path, env=ENV)  # fmt: skip
    assert captured.returncode == 0, captured.stderr
    assert [ln for ln in captured.stdout.splitlines() if ln.startswith("rank ")] == _plain_lines(tmp_path, 1)
    report = _report(db)
    assert [(r["rank"], r["status"], r["steps"]) for r in report["distributed"]["ranks"]] == [(0, "ok", 3)]
    assert report["numerics"]["coverage"]["ops_checked"] > 0
    assert not any("did not capture" in n or "any torch ops" in n for n in report["run"]["notes"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_accelerate_launch_module_records_every_process(tmp_path: Path) -> None:
    _write(tmp_path, "train.py", TRAIN)
    db = tmp_path / "store.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "trace", "-m", "accelerate.commands.launch",
                           *ACCELERATE_FLAGS, "train.py", cwd=tmp_path, env=ENV)  # fmt: skip
    assert captured.returncode == 0, captured.stderr
    assert sorted(ln for ln in captured.stdout.splitlines() if ln.startswith("rank ")) == _plain_lines(tmp_path, 2)
    _assert_two_rank_run(db)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_any_launcher_on_the_elastic_agent_is_reached(tmp_path: Path) -> None:
    """``elastic_launch`` with the interpreter itself as entrypoint: no ``PYTHON_EXEC`` is read on this path."""
    _write(tmp_path, "launcher.py", ELASTIC_LAUNCHER)
    _write(tmp_path, "worker.py", WORKER)
    db = tmp_path / "store.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "trace", "launcher.py", cwd=tmp_path, env=ENV)
    plain = _plain([sys.executable, "launcher.py"], tmp_path)
    assert captured.returncode == plain.returncode == 0, captured.stderr + plain.stderr
    assert sorted(captured.stdout.splitlines()) == sorted(plain.stdout.splitlines())
    report = _assert_two_rank_run(db)
    assert not any("did not capture" in n for n in report["run"]["notes"])


def test_python_processes_not_reached_are_named(tmp_path: Path) -> None:
    _write(tmp_path, "job.py", MISSED)
    db = tmp_path / "store.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "numerics", "job.py", cwd=tmp_path, env=ENV)
    plain = _plain([sys.executable, "job.py"], tmp_path)
    assert captured.returncode == plain.returncode == 0, captured.stderr
    assert captured.stdout == plain.stdout
    report = _report(db)
    (note,) = [n for n in report["run"]["notes"] if "did not capture" in n]
    assert note.startswith("the script started 2 Python process(es) that tpudiag did not capture")  # no DataLoader
    assert "multiprocessing: __main__.work" in note and "subprocess: python" in note.replace("python3", "python")
    assert "tpudiag capture" in note and "torchrun" in note
    assert not any("did the script run any torch ops" in n for n in report["run"]["notes"])
    assert "did the script run any torch ops" not in captured.stderr


def test_work_only_in_missed_processes_is_said_so(tmp_path: Path) -> None:
    script = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import torch; torch.ones(2).sum()'])\n"
    _write(tmp_path, "only.py", script)
    db = tmp_path / "store.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "numerics", "only.py", cwd=tmp_path, env=ENV)
    assert captured.returncode == 0, captured.stderr
    numerics = _report(db)["numerics"]
    assert numerics["coverage"]["ops_seen"] == 0
    assert "worker processes it started were not captured" in numerics["coverage"]["warning"]
    assert "did the script run any torch ops" not in captured.stderr


def test_a_script_without_workers_has_no_such_note(tmp_path: Path) -> None:
    _write(tmp_path, "solo.py", "import torch\nprint(torch.ones(3).sum().item())\n")
    db = tmp_path / "store.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "numerics", "solo.py", cwd=tmp_path, env=ENV)
    assert captured.returncode == 0, captured.stderr
    report = _report(db)
    assert not any("did not capture" in n for n in report["run"]["notes"])
    assert report["distributed"] is None


@pytest.mark.slow
def test_torchs_own_processes_are_not_missed(tmp_path: Path) -> None:
    """Inductor starts Python processes of its own (compile workers, a load test of each built library)."""
    script = (
        "import torch\n"
        "f = torch.compile(lambda x: torch.tanh(x) * 2 + 1, backend='inductor')\n"
        "print(f(torch.ones(8)).sum().item())\n"
    )
    _write(tmp_path, "compiled.py", script)
    db = tmp_path / "store.duckdb"
    env = {**ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a cold cache: every process starts
    captured = run_tpudiag("capture", "--db", str(db), "compiled.py", cwd=tmp_path, env=env)
    assert captured.returncode == 0, captured.stderr
    assert float(captured.stdout) == pytest.approx(8 * (2 * math.tanh(1.0) + 1), rel=1e-6)
    assert not any("did not capture" in n for n in _report(db)["run"]["notes"])


def test_console_scripts_are_found_on_path(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "mytool"
    tool.write_text(f"#!{sys.executable}\nimport sys\nprint('mytool', sys.argv[1:])\n")
    tool.chmod(0o755)
    shell = bin_dir / "shelltool"
    shell.write_text("#!/bin/sh\necho hi\n")
    shell.chmod(0o755)
    env = {**ENV, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    db = tmp_path / "store.duckdb"
    res = run_tpudiag("capture", "--db", str(db), "--collect", "none", "mytool", "a", "--b", cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "mytool ['a', '--b']\n"
    assert _report(db)["run"]["script"] == str(tool)
    bad = run_tpudiag("capture", "--db", str(db), "shelltool", cwd=tmp_path, env=env)
    assert bad.returncode != 0 and "is not a Python script" in bad.stderr and "Traceback" not in bad.stderr
    missing = run_tpudiag("capture", "--db", str(db), "no-such-tool-xyz", cwd=tmp_path, env=env)
    assert missing.returncode != 0 and "can't open file 'no-such-tool-xyz'" in missing.stderr
    # ``python script.py`` after capture is the script itself.
    _write(tmp_path, "s.py", "import sys; print('s', sys.argv[1:])\n")
    py = run_tpudiag("capture", "--db", str(db), "--collect", "none", "python", "s.py", "x", cwd=tmp_path, env=env)
    assert py.returncode == 0 and py.stdout == "s ['x']\n", py.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchtpu_session_id_is_the_run_id(tmp_path: Path) -> None:
    _write(tmp_path, "w.py", "import os\nprint('rank', os.environ['RANK'], flush=True)\n")
    db = tmp_path / "store.duckdb"
    session = "1764669600123456789"
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "w.py"]
    env = {**ENV, "TORCH_TPU_XPROF_SESSION_ID": session}
    res = run_tpudiag("capture", "--db", str(db), "--collect", "none", *torchrun, cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    assert f"run {session} (ok, exit 0)" in res.stderr
    report = _report(db)
    assert report["run"]["id"] == session and report["run"]["name"] == "w"
    assert [r["rank"] for r in report["distributed"]["ranks"]] == [0, 1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_torchrun_started_by_the_script_is_reached(tmp_path: Path) -> None:
    """An agent in a child process reads ``PYTHON_EXEC``: its workers are ranks, the launcher is no missed process."""
    _write(tmp_path, "worker.py", WORKER)
    start = (
        "import subprocess, sys\n"
        "subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', '2',"
        " 'worker.py'], check=True)\n"
    )
    _write(tmp_path, "outer.py", start)
    db = tmp_path / "store.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "trace", "outer.py", cwd=tmp_path, env=ENV)
    assert captured.returncode == 0, captured.stderr
    assert sorted(captured.stdout.splitlines()) == ["rank 0 sum 9.0", "rank 1 sum 9.0"]
    report = _assert_two_rank_run(db)
    assert not any("did not capture" in n for n in report["run"]["notes"])
