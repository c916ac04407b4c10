"""A multi-node torchrun job (one ``tpudiag capture`` per node) lands in one run.

Unit tests pin how every node derives the same run id and joins the run; one slow test runs two real torchrun
launchers on this machine as two nodes (``--nnodes 2 --node-rank 0/1``, c10d rendezvous on localhost, gloo, one
worker each) against one store.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import run_tpudiag
from tests.factories import make_run
from tpudiag.distributed import multinode
from tpudiag.errors import UsageError
from tpudiag.store import Store, queries

ENV = {"OMP_NUM_THREADS": "1", "TPUDIAG_FLUSH_S": "2"}


def test_job_id_leaves_the_launcher_module_unimported() -> None:
    # runpy runs torchrun's module as __main__ after this and warns on the user's stderr if it is imported already.
    sys.modules.pop("torch.distributed.run", None)
    assert multinode.job_id(["--nnodes", "2", "--rdzv-id", "a", "t.py"], None) == "a"
    assert "torch.distributed.run" not in sys.modules


def test_job_id_every_node_derives_the_same() -> None:
    two_nodes = ["--nnodes", "2", "--node-rank", "1", "--rdzv-id", "job 42", "train.py", "--rdzv-id", "x"]
    assert multinode.job_id(two_nodes, None) == "job-42"  # the launcher's own option, not the script's
    assert multinode.job_id(["--nnodes=2", "--rdzv_id=abc", "t.py"], None) == "abc"
    assert multinode.job_id(["--nnodes", "1", "--rdzv-id", "abc", "t.py"], None) is None  # single node: fresh id
    assert multinode.job_id(["--nnodes", "2", "t.py"], None) is None  # rdzv id "none"
    assert multinode.job_id(["--nproc-per-node", "2", "t.py"], "my/job") == "my-job"  # --run-id wins
    with pytest.raises(UsageError):
        multinode.clean_id("///")


def test_join_running_run_reused_id_moves_on(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    first, joined = multinode.join_or_create(store, "job", make_run(status="running"))
    assert (first.id, joined) == ("job", False)
    second, joined = multinode.join_or_create(store, "job", make_run(status="running", name="other"))
    assert (second.id, joined, second.name) == ("job", True, first.name)  # the node joins the first's run
    store.put_run(make_run(id="job", status="ok"))  # that job finished; a later job reuses the rendezvous id
    third, joined = multinode.join_or_create(store, "job", make_run(status="running"))
    assert (third.id, joined) == ("job.2", False)
    assert third.artifacts_dir == str(store.run_dir("job.2").resolve())


def test_nodes_outcomes_combine(tmp_path: Path) -> None:
    a, b = multinode.NodeMarker(tmp_path, "h", 1), multinode.NodeMarker(tmp_path, "h", 2)
    a.enter()
    b.enter()
    assert a.leave("failed", 1, ["node a note"]) == [{"host": "h", "pid": 2}]  # b still runs: a is not last
    assert b.leave("ok", 0, []) == []  # b is the last node out
    run = multinode.combine(make_run(status="ok", exit_code=0), b.outcomes())
    assert (run.status, run.exit_code, run.notes[-1]) == ("failed", 1, "node a note")


def test_run_id_needs_a_launcher(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    res = run_tpudiag("capture", "--db", str(tmp_path / "s.duckdb"), "--run-id", "x", str(script), cwd=tmp_path)
    assert res.returncode != 0 and "hi" not in res.stdout
    assert res.stderr.strip().count("\n") == 0 and "--run-id" in res.stderr and "Traceback" not in res.stderr


JOB = r"""
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    model(torch.ones(1, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
sys.stdout.write(f"rank {rank} of {dist.get_world_size()} done\n")
dist.barrier()  # torch 2.13's gloo aborts ~6% of exits without it (plain runs too)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_nodes_one_run(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(JOB))
    db = tmp_path / "store.duckdb"
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "TPUDIAG_DB"} | ENV
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tpudiag",
                "capture",
                "--db",
                str(db),
                "--collect",
                "trace",
                "torchrun",
                "--nnodes",
                "2",
                "--node-rank",
                str(node),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "twonodes",
                "--rdzv-conf",
                f"is_host={'true' if node == 0 else 'false'}",
                str(script),
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    outs = [p.communicate(timeout=240) for p in nodes]
    for p, (_, err) in zip(nodes, outs, strict=True):
        assert p.returncode == 0, err
    assert sorted(o for o, _ in outs) == ["rank 0 of 2 done\n", "rank 1 of 2 done\n"]
    store = Store(db)
    runs = queries.list_runs(store)
    assert [r["id"] for r in runs] == ["twonodes"]  # one run for the job, named by its rendezvous id
    res = subprocess.run(
        [sys.executable, "-m", "tpudiag", "report", "twonodes", "--db", str(db), "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["run"]["status"] == "ok" and report["run"]["exit_code"] == 0
    assert report["steps"]["count"] == 6  # both ranks' steps in the run's own tables, once
    dist = report["distributed"]
    assert dist["world_size"] == 2
    assert [(r["rank"], r["status"], r["steps"]) for r in dist["ranks"]] == [(0, "ok", 3), (1, "ok", 3)]
    assert all(r["collectives"] >= 6 for r in dist["ranks"])  # both nodes' all-reduces are in the run
    done = sorted(p.name for p in (Path(runs[0]["artifacts_dir"]) / "nodes").iterdir())
    assert len(done) == 2 and all(n.endswith(".done") for n in done)
