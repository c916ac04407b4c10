"""Distributed jobs captured end to end: torchrun and torch.multiprocessing.spawn on gloo, 2 ranks, CPU.

Three jobs, each run once per module (they take most of this file's time): a DDP job with a sleeping rank, a
gradient perturbed on one rank and a rank-dependent collective shape; a job whose rank 1 raises in every attempt
under ``--max-restarts 1``; and an ``mp.spawn`` job whose spawn index is not its rank.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.conftest import run_plain_reference, run_tpudiag

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # real torchrun / mp.spawn / Spark jobs
ENV = {"OMP_NUM_THREADS": "1", "TPUDIAG_FLUSH_S": "2"}

DDP_JOB = r"""
import sys, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(1))
for step in range(5):
    loss = model(data[step]).sum()
    if rank == 1:
        time.sleep(0.08)  # rank 1 arrives last at every gradient all-reduce
    loss.backward()
    if rank == 1 and step == 3:
        with torch.no_grad():
            model.module.weight.grad.add_(1e-3)  # after the all-reduce: only rank 1's numbers change
    opt.step()
    opt.zero_grad()
    sys.stdout.write(f"rank {rank} step {step} loss {loss.item():.6f}\n")  # one write: lines never interleave
t = torch.ones(2, 3) if rank == 0 else torch.ones(3, 2)  # same element count: gloo does not notice
dist.all_reduce(t)
sys.stdout.write(f"rank {rank} sum {t.sum().item()}\n")
dist.barrier()  # torch 2.13's gloo aborts ~6% of exits without it (plain runs too)
dist.destroy_process_group()
"""

FAILING_JOB = r"""
import os, sys, time
from torch.distributed.elastic.multiprocessing.errors import record

@record
def main():
    rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
    sys.stdout.write(f"rank {rank} attempt {attempt}\n")
    sys.stdout.flush()
    # Rank 1 fails only once rank 0 has printed: the agent then stops rank 0, and on a loaded machine it had stopped
    # a rank 0 still starting, its line never written (a CI run lost "rank 0 attempt 1").
    printed = f"rank0-attempt{attempt}.printed"
    if rank == 1:
        deadline = time.time() + 120
        while not os.path.exists(printed) and time.time() < deadline:
            time.sleep(0.05)
        raise RuntimeError(f"boom on rank {rank}")
    open(printed, "w").close()
    time.sleep(3)

main()
"""

SPAWN_JOB = r"""
import os, torch, torch.distributed as dist, torch.multiprocessing as mp

def work(i, world):
    dist.init_process_group("gloo", rank=world - 1 - i, world_size=world)  # spawn index != rank
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.ones(1, 4)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    os.write(1, f"index {i} rank {dist.get_rank()} pid {os.getpid()}\n".encode())
    dist.barrier()  # torch 2.13's gloo aborts ~6% of exits without it (plain runs too)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(work, args=(2,), nprocs=2)
"""


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def _report(db: Path) -> dict[str, Any]:
    res = run_tpudiag("report", "--db", str(db), "--json")
    assert res.returncode == 0, res.stderr
    data: dict[str, Any] = json.loads(res.stdout)
    return data


def _torchrun(*args: str) -> list[str]:
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("ddp")
    script = _write(folder, "train.py", DDP_JOB)
    db = folder / "store.duckdb"
    captured = run_tpudiag(
        "capture", "--db", str(db), "--collect", "trace", *_torchrun(str(script)), cwd=folder, env=ENV
    )
    plain = run_plain_reference([sys.executable, *_torchrun(str(script))], folder, {**os.environ, **ENV})
    return {"folder": folder, "db": db, "captured": captured, "plain": plain, "report": _report(db)}


def test_job_output_and_exit_status_unchanged(ddp_job: dict[str, Any]) -> None:
    captured, plain = ddp_job["captured"], ddp_job["plain"]
    assert plain.returncode == 0, plain.stderr
    assert captured.returncode == 0, captured.stderr
    # Two ranks write to one stdout, so line order varies between runs; the lines themselves must not.
    assert sorted(captured.stdout.splitlines()) == sorted(plain.stdout.splitlines())
    assert len(captured.stdout.splitlines()) == 12


def test_one_run_with_every_rank(ddp_job: dict[str, Any]) -> None:
    report = ddp_job["report"]
    assert report["run"]["status"] == "ok"
    # The launcher's record is built by the same session as any capture's: the active precision is recorded.
    assert report["run"]["precision"].get("float32_matmul_precision") == "highest"
    dist = report["distributed"]
    assert dist["world_size"] == 2
    assert dist["backend"] == "gloo"
    assert [r["rank"] for r in dist["ranks"]] == [0, 1]
    assert all(r["status"] == "ok" and r["steps"] == 5 for r in dist["ranks"])
    assert len({r["pid"] for r in dist["ranks"]}) == 2
    # Every rank's pulse and trace window are the run's (a long run's step figures come from the pulse), and each
    # window's first event id points at its own rank's events.
    assert report["pulse"]["ranks"] == 2 and report["pulse"]["steps"] == 5
    windows = report["windows"]
    assert sorted(w["rank"] for w in windows) == [0, 1] and all(w["top_ops"] for w in windows), windows
    with duckdb.connect(str(ddp_job["db"]), read_only=True) as con:
        ranks = con.execute("SELECT DISTINCT rank FROM trace_events ORDER BY rank").fetchall()
        ids = con.execute("SELECT count(*) = count(DISTINCT event_id) FROM trace_events").fetchall()
        runs = con.execute("SELECT count(*) FROM runs").fetchall()
    assert ranks == [(0,), (1,)]  # every rank's events in the run, ids kept unique
    assert ids == [(True,)]
    assert runs == [(1,)]  # the launcher is no run of its own


def test_sleeping_rank_is_the_straggler(ddp_job: dict[str, Any]) -> None:
    stragglers = ddp_job["report"]["distributed"]["stragglers"]
    assert stragglers and stragglers[0]["rank"] == 1
    assert stragglers[0]["kind"] == "chronic"
    assert stragglers[0]["late_at"] >= 5  # every gradient all-reduce
    ranks = {r["rank"]: r for r in ddp_job["report"]["distributed"]["ranks"]}
    assert ranks[1]["collective_s"] < ranks[0]["collective_s"]  # it waits least: the others wait for it


def test_rank_dependent_shape_is_a_collective_mismatch(ddp_job: dict[str, Any]) -> None:
    mismatch = ddp_job["report"]["distributed"]["collective_mismatch"]
    assert mismatch is not None
    sides = {tuple(s["ranks"]): s for s in mismatch["sides"]}
    assert sides[(0,)]["shapes"] == [[2, 3]] and sides[(1,)]["shapes"] == [[3, 2]]
    assert sides[(0,)]["op"] == sides[(1,)]["op"] == "all_reduce"
    text = subprocess.run(
        [sys.executable, "-m", "tpudiag", "report", "--db", str(ddp_job["db"])], capture_output=True, text=True
    ).stdout
    assert "rank 0 all_reduce [[2, 3]] vs rank 1 all_reduce [[3, 2]]" in text


def test_perturbed_gradient_names_its_rank(ddp_job: dict[str, Any]) -> None:
    divergence = ddp_job["report"]["distributed"]["rank_divergence"]
    assert divergence is not None
    assert [d["rank"] for d in divergence["ranks"]] == [1]
    assert divergence["ranks"][0]["from_step"] == 3
    assert divergence["ranks"][0]["kind"] == "grad"
    assert divergence["reference_ranks"] == [0]


def test_shards_are_one_hive_glob(ddp_job: dict[str, Any]) -> None:
    run_id = ddp_job["report"]["run"]["id"]
    root = Path(ddp_job["report"]["run"]["artifacts_dir"]) / "shards"
    glob = str(root / "steps" / "*" / "*" / "*.parquet")
    with duckdb.connect() as con:
        rows = con.execute(
            f"SELECT run_id, rank, count(*) FROM read_parquet('{glob}', hive_partitioning = true) "
            "GROUP BY ALL ORDER BY rank"
        ).fetchall()
    assert rows == [(run_id, 0, 5), (run_id, 1, 5)]


def test_failing_rank_with_restarts_keeps_both_attempts(tmp_path: Path) -> None:
    script = _write(tmp_path, "job.py", FAILING_JOB)
    db = tmp_path / "store.duckdb"
    res = run_tpudiag(
        "capture",
        "--db",
        str(db),
        "--collect",
        "none",
        *_torchrun("--max-restarts", "1", str(script)),
        cwd=tmp_path,
        env=ENV,
    )
    assert res.returncode == 1, res.stderr  # the launcher's exit status: the job failed after its restart
    assert "boom on rank 1" in res.stderr
    report = _report(db)
    assert report["run"]["status"] == "failed"
    dist = report["distributed"]
    assert [a["attempt"] for a in dist["attempts"]] == [0, 1]
    for attempt in dist["attempts"]:
        assert attempt["first_failure"]["rank"] == 1
        assert "boom on rank 1" in attempt["first_failure"]["error"]
    assert any("rank 1 failed first" in n and "boom on rank 1" in n for n in report["run"]["notes"])
    assert sorted(res.stdout.splitlines()) == [
        "rank 0 attempt 0",
        "rank 0 attempt 1",
        "rank 1 attempt 0",
        "rank 1 attempt 1",
    ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_spawned_workers_are_ranks(tmp_path: Path) -> None:
    script = _write(tmp_path, "spawn_job.py", SPAWN_JOB)
    db = tmp_path / "store.duckdb"
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    res = run_tpudiag("capture", "--db", str(db), "--collect", "trace", str(script), cwd=tmp_path, env=env)
    assert res.returncode == 0, res.stderr
    pids: dict[int, tuple[int, int]] = {}
    for line in res.stdout.splitlines():
        words = line.split()  # "index I rank R pid P"
        pids[int(words[3])] = (int(words[1]), int(words[5]))
    dist = _report(db)["distributed"]
    assert dist["world_size"] == 2
    got = {r["rank"]: r for r in dist["ranks"]}
    assert sorted(got) == [0, 1]
    for rank, (spawn_index, pid) in pids.items():
        assert spawn_index == 1 - rank
        assert got[rank]["pid"] == pid  # the rank learned at init_process_group, not the spawn index
        assert got[rank]["steps"] == 2
    assert dist["rank_divergence"] is None  # same seed, all-reduced gradients: same numbers


SPARK_QUERY = """
SELECT CAST(rank AS INT) AS rank, count(*) AS collectives, sum(dur_ns) AS collective_ns
FROM trace_events
WHERE category = 'user_annotation' AND (name LIKE 'gloo:%' OR name LIKE 'nccl:%')
GROUP BY rank ORDER BY rank
"""


def test_spark_reads_the_shards_with_the_reports_per_rank_totals(ddp_job: dict[str, Any]) -> None:
    pytest.importorskip("pyspark")
    if shutil.which("java") is None:
        pytest.skip("no Java runtime (.ci/run installs one)")
    from pyspark.sql import SparkSession

    root = Path(ddp_job["report"]["run"]["artifacts_dir"]) / "shards"
    spark = (
        SparkSession.builder.master("local[1]")
        .appName("tpudiag-shards")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "1")
        # Partition values as strings: a run id must never be read as a date or a number.
        .config("spark.sql.sources.partitionColumnTypeInference.enabled", "false")
        .getOrCreate()
    )
    try:
        spark.read.parquet(str(root / "trace_events")).createOrReplaceTempView("trace_events")
        spark.read.parquet(str(root / "steps")).createOrReplaceTempView("steps")
        colls = [r.asDict() for r in spark.sql(SPARK_QUERY).collect()]
        steps = {
            r["rank"]: r["n"]
            for r in spark.sql("SELECT CAST(rank AS INT) AS rank, count(*) AS n FROM steps GROUP BY rank").collect()
        }
        run_ids = {r[0] for r in spark.sql("SELECT DISTINCT run_id FROM steps").collect()}
    finally:
        spark.stop()
    assert run_ids == {ddp_job["report"]["run"]["id"]}
    ranks = {r["rank"]: r for r in ddp_job["report"]["distributed"]["ranks"]}
    assert [c["rank"] for c in colls] == [0, 1]
    for c in colls:
        assert c["collectives"] == ranks[c["rank"]]["collectives"]
        assert c["collective_ns"] / 1e9 == pytest.approx(ranks[c["rank"]]["collective_s"], abs=2e-6)
        assert steps[c["rank"]] == ranks[c["rank"]]["steps"] == 5


def test_parquet_export_writes_the_same_layout(ddp_job: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "export"
    res = run_tpudiag("export", "--db", str(ddp_job["db"]), "--format", "parquet", "--out", str(out))
    assert res.returncode == 0, res.stderr
    ranks = {r["rank"]: r for r in ddp_job["report"]["distributed"]["ranks"]}
    glob = str(out / "shards" / "dist_collectives" / "*" / "*" / "*.parquet")
    with duckdb.connect() as con:
        rows = con.execute(
            f"SELECT rank, count(*), sum(dur_ns) FROM read_parquet('{glob}', hive_partitioning = true) "
            "GROUP BY rank ORDER BY rank"
        ).fetchall()
    assert [(r, n) for r, n, _ in rows] == [(k, ranks[k]["collectives"]) for k in (0, 1)]
