"""A pod with no shared disk: two torchrun "nodes" on this machine, each with its own store and run folder,
uploading to a real S3 server (moto, through s3fs) or a GCS emulator (through gcsfs) on loopback; then
``gather`` and ``report --remote`` read the job back as one run.

Slow tests: every one runs two real torchrun launchers (c10d rendezvous on 127.0.0.1, gloo, one worker each).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_plain_reference
from tests.remote_servers import SECRET, free_port, gcs_server, s3_server
from tpudiag.store import Store, queries

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

JOB = r"""
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
rank = dist.get_rank()
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
steps = int(os.environ.get("JOB_STEPS", "3"))
for step in range(steps):
    if rank == 1:
        time.sleep(float(os.environ.get("JOB_SLEEP", "0")))
    model(torch.ones(1, 4)).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
sys.stdout.write(f"rank {rank} of {dist.get_world_size()} done {model.weight.sum().item():.6f}\n")
dist.barrier()  # torch 2.13's gloo aborts ~6% of exits without it (plain runs too)
dist.destroy_process_group()
"""


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TPUDIAG_DB"}
    env.update({"OMP_NUM_THREADS": "1", "TPUDIAG_FLUSH_S": "1", "TPUDIAG_UPLOAD_S": "1"})
    env["TPUDIAG_UPLOAD_GIVE_UP_S"] = "60"
    env.update(extra)
    return env


def start_nodes(tmp: Path, url: str, rdzv: str, env: dict[str, str], extra: tuple[str, ...] = ()) -> list[Any]:
    script = tmp / "train.py"
    script.write_text(textwrap.dedent(JOB))
    port = free_port()
    procs = []
    for node in (0, 1):
        home = tmp / f"node{node}"  # its own store, run folder and working directory: nothing shared
        home.mkdir(exist_ok=True)
        cmd = [
            sys.executable, "-m", "tpudiag", "capture", "--db", str(home / "store.duckdb"), "--collect", "trace",
            "--remote", url, *extra,
            "torchrun", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", rdzv,
            "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}", str(script),
        ]  # fmt: skip
        out = subprocess.PIPE
        procs.append(
            subprocess.Popen(cmd, cwd=home, env=env, stdout=out, stderr=out, text=True, start_new_session=True)
        )
    return procs


def wait_uploads(tmp: Path, run_id: str, timeout: float = 120, nodes: tuple[int, ...] = (0, 1)) -> list[str]:
    states = []
    for node in nodes:
        status = tmp / f"node{node}" / "store.runs" / run_id / "upload" / "status.json"
        deadline = time.monotonic() + timeout
        while not status.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        states.append(json.loads(status.read_text())["state"] if status.is_file() else "none")
    return states


def tpudiag(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tpudiag", *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=240
    )


def grep_secret(tmp: Path, texts: list[str]) -> list[str]:
    hits = [f"output {i}" for i, t in enumerate(texts) if SECRET in t]
    for path in tmp.rglob("*"):
        if path.is_file() and SECRET.encode() in path.read_bytes():
            hits.append(str(path))
    return hits


def mirror(fs: Any, prefix: str, out: Path) -> None:
    """Every object under ``prefix`` copied to ``out`` through the same fsspec client (for Spark)."""
    for obj in fs.find(prefix):
        target = out / obj[len(prefix) :].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(obj, str(target))


def two_node_job(tmp: Path, url: str, server_env: dict[str, str], rdzv: str) -> dict[str, Any]:
    env = _env(server_env)
    procs = start_nodes(tmp, url, rdzv, env)
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert sorted(o.split(" done")[0] for o, _ in outs) == ["rank 0 of 2", "rank 1 of 2"]
    assert wait_uploads(tmp, rdzv) == ["done", "done"]
    reader = tmp / "reader"
    reader.mkdir()
    gathered = tpudiag("gather", url, "--run", rdzv, "--db", str(reader / "g.duckdb"), env=env, cwd=reader)
    assert gathered.returncode == 0, gathered.stderr
    local = tpudiag("report", rdzv, "--db", str(reader / "g.duckdb"), "--json", env=env, cwd=reader)
    assert local.returncode == 0, local.stderr
    remote = tpudiag("report", "--remote", url, rdzv, "--json", env=env, cwd=reader)
    assert remote.returncode == 0, remote.stderr
    texts = [o for pair in outs for o in pair] + [r.stdout + r.stderr for r in (gathered, local, remote)]
    return {"outs": outs, "local": json.loads(local.stdout), "remote": json.loads(remote.stdout), "texts": texts}


def check_one_run(result: dict[str, Any]) -> None:
    local, remote = result["local"], result["remote"]
    dist = local["distributed"]
    assert local["run"]["status"] == "ok" and local["run"]["exit_code"] == 0
    assert dist["world_size"] == 2
    assert [(r["rank"], r["status"], r["steps"]) for r in dist["ranks"]] == [(0, "ok", 3), (1, "ok", 3)]
    assert all(r["collectives"] >= 6 for r in dist["ranks"])
    assert len({r["pid"] for r in dist["ranks"]}) == 2  # one rank from each node
    assert local["steps"]["count"] == 6  # both nodes' steps are in the gathered run's own tables
    assert remote["distributed"] == dist  # read in place, the same answers as the gathered run
    assert [n["finished"] for n in remote["nodes"]] == [True, True]


def test_two_nodes_s3(tmp_path: Path) -> None:
    with s3_server() as s3:
        result = two_node_job(tmp_path, "s3://pod/jobs", s3.env, "s3job")
        check_one_run(result)
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        objects = fs.find("pod/jobs")
        assert any("/node=" in o and "/rank=0/" in o and o.startswith("pod/jobs/shards/") for o in objects)
        assert any(o.endswith("/complete.json") for o in objects)
        assert not any(o.endswith(".tmp") for o in objects)
        bucket_copy = tmp_path / "bucket-copy"
        mirror(fs, "pod/jobs", bucket_copy)
    # Spark reads the bucket's objects (a plain local copy: s3a needs hadoop-aws jars, not installable here).
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.master("local[1]").appName("tpudiag-pod").getOrCreate()
    try:
        steps = spark.read.option("basePath", str(bucket_copy / "shards" / "steps")).parquet(
            str(bucket_copy / "shards" / "steps")
        )
        rows = steps.groupBy("rank").count().orderBy("rank").collect()
        per_rank = {int(r["rank"]): int(r["count"]) for r in rows}
        ranks = spark.read.parquet(str(bucket_copy / "shards" / "dist_ranks")).select("rank", "node", "host").collect()
    finally:
        spark.stop()
    dist = result["local"]["distributed"]
    assert per_rank == {r["rank"]: r["steps"] for r in dist["ranks"]}  # Spark agrees with the report
    assert len({r["node"] for r in ranks}) == 2  # the node partition tells the two launchers apart
    assert grep_secret(tmp_path, result["texts"]) == []


def test_two_nodes_gcs(tmp_path: Path) -> None:
    with gcs_server(tmp_path) as gcs:
        result = two_node_job(tmp_path, "gs://pod/jobs", gcs.env, "gcsjob")
        check_one_run(result)
    assert grep_secret(tmp_path, result["texts"]) == []


def _listed_objects_whole(fs: Any, prefix: str) -> dict[str, list[str]]:
    """node -> objects its manifests name; every one exists and every Parquet one reads whole."""
    import pyarrow.parquet as pq

    named: dict[str, list[str]] = {}
    for manifest in fs.glob(f"{prefix}/manifests/run_id=*/node=*/manifest-*.json"):
        node = manifest.split("/node=", 1)[1].split("/", 1)[0]
        for obj in json.loads(fs.cat_file(manifest))["objects"]:
            path = f"{prefix}/{obj['object']}"
            assert fs.size(path) == obj["size"]
            if path.endswith(".parquet"):
                with fs.open(path, "rb") as fh:
                    pq.read_table(fh)
            named.setdefault(node, []).append(obj["object"])
    return named


def test_node_killed_mid_run(tmp_path: Path) -> None:
    with s3_server() as s3:
        env = _env(s3.env | {"JOB_STEPS": "400", "JOB_SLEEP": "0.05"})
        # --trace all: the surviving rank's steps come from its whole-run trace, flushed chunk by chunk; with the
        # default trace windows its open first window dies with the job (the merge does not read ranks' pulses yet).
        procs = start_nodes(tmp_path, "s3://pod/k", "killjob", env, extra=("--trace", "all"))
        sent = tmp_path / "node1" / "store.runs" / "killjob" / "upload" / "uploaded.jsonl"
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and "/dist_fingerprints/" not in (sent.read_text() if sent.is_file() else ""):
            time.sleep(0.2)
        assert "/dist_fingerprints/" in sent.read_text()  # node 1 is mid-run: some of its parts are in the bucket
        # The whole of node 1 dies at once: its launcher, its worker (torchrun starts workers in sessions of
        # their own) and its uploader.
        run1 = tmp_path / "node1" / "store.runs" / "killjob"
        workers = [int(d.name.split("-", 1)[1]) for d in (run1 / "workers").iterdir()]
        uploader = int((run1 / "upload" / "uploader.pid").read_text())
        for pid in [procs[1].pid, *workers, uploader]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        procs[1].wait(timeout=30)
        procs[0].communicate(timeout=240)
        assert procs[0].returncode != 0  # its peer vanished: torchrun on node 0 reports the failure
        assert wait_uploads(tmp_path, "killjob", nodes=(0,)) == ["done"]
        assert not (run1 / "upload" / "status.json").exists()  # node 1's uploader died with it
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        named = _listed_objects_whole(fs, "pod/k")
        assert len(named) == 2
        completes = fs.glob("pod/k/manifests/run_id=killjob/node=*/complete.json")
        assert len(completes) == 1  # the killed node never wrote its completion marker
        reader = tmp_path / "reader"
        reader.mkdir()
        res = tpudiag("report", "--remote", "s3://pod/k", "killjob", "--json", env=env, cwd=reader)
        assert res.returncode == 0, res.stderr
        data = json.loads(res.stdout)
        killed = next(n for n in data["nodes"] if not n["finished"])
        dist = data["distributed"]
        by_status = {r["status"]: r for r in dist["ranks"]}
        assert set(by_status) == {"lost", "failed"}
        assert by_status["lost"]["pid"] is None  # no rank record from the killed rank: named lost
        assert by_status["failed"]["steps"] > 0 and by_status["failed"]["pid"]  # the other node's record is whole
        assert any(killed["node"] in n for n in data["run"]["notes"])
        g = tpudiag("gather", "s3://pod/k", "--db", str(reader / "g.duckdb"), env=env, cwd=reader)
        assert g.returncode == 0 and "no completion marker" in g.stdout, g.stderr
        store = Store(reader / "g.duckdb")
        assert queries.list_runs(store)[0]["status"] == "failed"


def test_upload_server_down_for_a_while(tmp_path: Path) -> None:
    script_env = {"JOB_STEPS": "6", "JOB_SLEEP": "0.2"}
    with s3_server() as s3:
        env = _env(s3.env | script_env)
        s3.stop()  # down before the job starts, and until well after it ends
        procs = start_nodes(tmp_path, "s3://pod/down", "downjob", env)
        outs = [p.communicate(timeout=240) for p in procs]
        assert [p.returncode for p in procs] == [0, 0]  # the job neither waited for nor failed on the bucket
        status = tmp_path / "node0" / "store.runs" / "downjob" / "upload" / "status.json"
        assert not status.exists()  # still retrying
        time.sleep(20)  # longer than the S3 client's own retries of a refused connection: the uploader's retry shows
        s3.start()
        assert wait_uploads(tmp_path, "downjob") == ["done", "done"]
        log = (tmp_path / "node0" / "store.runs" / "downjob" / "upload" / "uploader.log").read_text()
        assert "EndpointConnectionError" in log or "Connect" in log  # it did retry
        reader = tmp_path / "reader"
        reader.mkdir()
        db = str(reader / "g.duckdb")
        g = tpudiag("gather", "s3://pod/down", "--run", "downjob", "--db", db, env=env, cwd=reader)
        assert g.returncode == 0, g.stderr
        rep = tpudiag("report", "downjob", "--db", str(reader / "g.duckdb"), "--json", env=env, cwd=reader)
        dist = json.loads(rep.stdout)["distributed"]
        assert [(r["rank"], r["status"], r["steps"]) for r in dist["ranks"]] == [(0, "ok", 6), (1, "ok", 6)]
    # The job's own output is what plain torchrun prints (same seed, all-reduced weights).
    plain = run_plain_reference(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(tmp_path / "train.py")],
        tmp_path, _env(script_env), timeout=240,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    assert sorted(o for o, _ in outs) == sorted(plain.stdout.splitlines(keepends=True))
    assert grep_secret(tmp_path, [o for pair in outs for o in pair] + [g.stdout, g.stderr]) == []


def test_trace_ranks_one_node_file_bucket(tmp_path: Path) -> None:
    """``--trace-ranks last``: only the last rank records a trace; a file:// bucket end to end, one node."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(JOB))
    bucket = tmp_path / "bucket"
    env = _env({})
    res = tpudiag(
        "capture", "--db", str(tmp_path / "s.duckdb"), "--collect", "trace", "--remote", f"file://{bucket}",
        "--trace-ranks", "last", "torchrun", "--nproc-per-node", "2", str(script), env=env, cwd=tmp_path,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    # The uploader runs on after the capture has returned (a busy machine: the bucket may still be empty here).
    (run_dir,) = [p for p in (tmp_path / "s.runs").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert wait_uploads_at(run_dir) == "done"
    assert next((bucket / "manifests").iterdir()).name.split("=", 1)[1] == run_dir.name
    rep = tpudiag("report", "--remote", f"file://{bucket}", "--json", env=env, cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    ranks = json.loads(rep.stdout)["distributed"]["ranks"]
    assert [(r["rank"], r["status"], r["steps"] > 0) for r in ranks] == [(0, "ok", False), (1, "ok", True)]
    assert not list((bucket / "shards" / "trace_events").glob("*/*/rank=0/*.parquet"))


def wait_uploads_at(run_dir: Path, timeout: float = 120) -> str:
    status = run_dir / "upload" / "status.json"
    deadline = time.monotonic() + timeout
    while not status.is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    return str(json.loads(status.read_text())["state"]) if status.is_file() else "none"
