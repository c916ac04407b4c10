"""A 256-rank job in an emulated bucket: ``report --remote`` read in place vs the same run gathered locally.

The job is ``bench_distributed``'s synthetic one (a rank record, 200 steps, trace events with one gloo all-reduce
per 5 events, fingerprints, compile events per rank; rank 17 the straggler), its ranks spread over 8 nodes of 32,
each node's run folder uploaded by the real uploader (``tpudiag.remote.uploader``) to moto's S3 server on
loopback through s3fs.  Then, each as a command in a subprocess that reports its own peak RSS (``VmHWM``):

- ``tpudiag report --remote s3://... RUN --json`` (DuckDB over the bucket's Parquet through fsspec);
- ``tpudiag gather s3://... --run RUN`` then ``tpudiag report RUN --json`` on the gathered local run (baseline);
- ``report --remote`` on a one-rank run in the same bucket (memory baseline: what does not grow with ranks).

Both must give the same distributed section and name the straggler.  Then ``report --remote`` from a ``file://``
bucket on jobs of 64, 256 and 1,024 ranks: how its peak grows with the number of ranks.  Emulated bucket on
loopback: the times say nothing about a real bucket's latency, only how the two ways compare on this machine.

    python -m bench.run remote        # TPUDIAG_BENCH_RANKS=64 TPUDIAG_BENCH_RANK_EVENTS=1000 for a quick look
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_distributed import _PEAK_RSS_MAIN, STRAGGLER, write_job
from tpudiag.remote.uploader import UploadConfig, Uploader

NODES = 8


def _cmd(args: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_MAIN, *args], capture_output=True, text=True, env=env, check=True
    )
    took = time.perf_counter() - t0
    return took, int(out.stderr.strip().splitlines()[-1]) / 1024, out.stdout


GROWTH_RANKS = tuple(int(r) for r in os.environ.get("TPUDIAG_BENCH_GROWTH_RANKS", "64,256,1024").split(",") if r)
GROWTH_EVENTS = 1000


def _growth_with_ranks(folder: Path, env: dict[str, str]) -> list[dict[str, float]]:
    """``report --remote file://...`` peak RSS (MB) for jobs of GROWTH_RANKS ranks in one bucket."""
    bucket = f"file://{folder / 'bucket'}"
    peaks: list[dict[str, float]] = []
    for ranks in GROWTH_RANKS:
        run_dir, run_id = folder / f"job{ranks}", f"grow{ranks}"
        write_job(run_dir, run_id, ranks, GROWTH_EVENTS)
        config = UploadConfig(bucket, run_id, "host0-1", "host0", os.getpid())
        config.save(run_dir)
        assert Uploader(run_dir, config, give_up_s=60).finish({"status": "ok", "exit_code": 0})
        shutil.rmtree(run_dir)
        peaks.append(
            {"ranks": ranks, "peak_mb": round(_cmd(["report", "--remote", bucket, run_id, "--json"], env)[1], 1)}
        )
    return peaks


def main() -> dict[str, Any]:
    from tests.remote_servers import s3_server

    ranks = int(os.environ.get("TPUDIAG_BENCH_RANKS", "256"))
    events = int(os.environ.get("TPUDIAG_BENCH_RANK_EVENTS", "2000"))
    run_id = "podbench"
    with tempfile.TemporaryDirectory(prefix="tpudiag-bench-remote-") as tmp, s3_server("bench") as s3:
        folder = Path(tmp)
        whole = folder / "whole"
        write_job(whole, run_id, ranks, events)
        per_node = max(1, ranks // NODES)
        t0 = time.perf_counter()
        objects = 0
        for node in range((ranks + per_node - 1) // per_node):
            node_dir = folder / f"node{node}"
            for table_dir in (whole / "shards").iterdir():
                for rank in range(node * per_node, min(ranks, (node + 1) * per_node)):
                    src = table_dir / f"run_id={run_id}" / f"rank={rank}"
                    if src.is_dir():
                        shutil.copytree(src, node_dir / "shards" / table_dir.name / f"run_id={run_id}" / src.name)
            config = UploadConfig("s3://bench/pod", run_id, f"host{node}-1", f"host{node}", os.getpid())
            config.save(node_dir)
            up = Uploader(node_dir, config, give_up_s=60)
            outcome = {"status": "ok", "exit_code": 0, "notes": [], "run": {"name": "bench", "started_at": 0.0}}
            assert up.finish(outcome)
            objects += len(up.uploaded)
        upload_s = time.perf_counter() - t0
        # Baseline for memory: the same command on a one-rank run in the same bucket (the fixed cost: imports, the
        # bucket client and its service model), so the ratio says how the read grows with ranks.
        one = folder / "one"
        write_job(one, "podbench1", 1, events)
        one_config = UploadConfig("s3://bench/pod", "podbench1", "host0-2", "host0", os.getpid())
        one_config.save(one)
        assert Uploader(one, one_config, give_up_s=60).finish({"status": "ok", "exit_code": 0})
        env = {**os.environ, **s3.env}
        env.pop("TPUDIAG_DB", None)
        one_s, one_mb, _ = _cmd(["report", "--remote", "s3://bench/pod", "podbench1", "--json"], env)
        remote_s, remote_mb, remote_out = _cmd(["report", "--remote", "s3://bench/pod", run_id, "--json"], env)
        db = str(folder / "gathered.duckdb")
        gather_s, gather_mb, _ = _cmd(["gather", "s3://bench/pod", "--run", run_id, "--db", db], env)
        local_s, local_mb, local_out = _cmd(["report", run_id, "--db", db, "--json"], env)
        # What the bucket client alone costs: ``tpudiag --version`` after importing s3fs and the remote reader.
        imports = "import s3fs, tpudiag.remote.reader; " + _PEAK_RSS_MAIN
        out = subprocess.run(
            [sys.executable, "-c", imports, "--version"], capture_output=True, text=True, env=env, check=False
        )
        client_mb = int(out.stderr.strip().splitlines()[-1]) / 1024
        growth = _growth_with_ranks(folder / "growth", env)
    remote = json.loads(remote_out)["distributed"]
    local = json.loads(local_out)["distributed"]
    return {
        "ranks": ranks,
        "nodes": NODES,
        "events": ranks * events,
        "objects_uploaded": objects,
        "upload_s": round(upload_s, 2),
        "report_remote_s": round(remote_s, 2),
        "report_remote_peak_mb": round(remote_mb, 1),
        "client_imports_peak_mb": round(client_mb, 1),  # s3fs + the reader imported, nothing read
        "report_remote_1_rank_s": round(one_s, 2),
        "report_remote_1_rank_peak_mb": round(one_mb, 1),
        "gather_s": round(gather_s, 2),
        "gather_peak_mb": round(gather_mb, 1),
        "report_gathered_s": round(local_s, 2),
        "report_gathered_peak_mb": round(local_mb, 1),
        "same_distributed_section": remote == local,
        "straggler_named": bool(remote["stragglers"]) and remote["stragglers"][0]["rank"] == STRAGGLER
        if ranks > STRAGGLER
        else None,
        "ratios": {
            "report_remote_vs_gather_plus_report_s": round(remote_s / (gather_s + local_s), 2),
            "report_remote_vs_gathered_report_peak_mb": round(remote_mb / local_mb, 2),
            "report_remote_peak_mb_256_vs_1_rank": round(remote_mb / one_mb, 2),
        },
        # The same command from a file:// bucket (no client), one node, GROWTH_EVENTS events a rank: how its peak
        # grows with the number of ranks, past the 256 of the S3 bucket.
        "file_bucket_peak_mb_by_ranks": growth,
        "note": "emulated bucket (moto S3 on loopback): no network latency; compare the two ways, not absolutes",
    }
