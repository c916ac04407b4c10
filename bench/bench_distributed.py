"""A 256-rank job from synthetic shards: merge, the report's distributed section, straggler query, report memory.

Each rank writes its shards through the real ``ShardSpool`` (hive layout): a rank record, 200 optimizer steps,
trace events (``TPUDIAG_BENCH_RANK_EVENTS`` per rank, default 4000, of which one gloo all-reduce per 5 events),
fingerprints and compile events.  Rank 17 is a straggler (it waits least at every all-reduce) and the benchmark
checks that the report names it.

Baseline, measured in the same run: the same job with one rank (ratios say how the distributed work grows with
ranks).  Peak memory of ``tpudiag report --json``: ``report_peak_mb`` is the whole command's peak RSS (its own
``VmHWM``, read by the command itself at exit: ``ru_maxrss`` of a child counts the parent's pages at fork, so it
measured the benchmark's process, not the report), ``report_python_peak_mb`` what the report's Python objects
peak at (``tracemalloc`` around a second ``report.build`` in this process, imports done).  The report
aggregates per-rank data in SQL, so both stay nearly flat from 1 to 256 ranks (the ratios say by how much they
grow: the Python peak by the per-rank rows only).

    python -m bench.run distributed       # TPUDIAG_BENCH_RANKS=64 for a quicker look
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tpudiag import report
from tpudiag.distributed import merge, report_section
from tpudiag.distributed.records import Fingerprint, RankInfo
from tpudiag.distributed.shards import ShardSpool, table_glob
from tpudiag.model import CompileEvent, Run, Step, TraceEvent, arrow_schema
from tpudiag.store import Store, queries

STRAGGLER = 17
STEPS = 200
# ``python -m tpudiag`` that prints its own peak RSS (kB) as the last stderr line.
_PEAK_RSS_MAIN = """
import sys
from tpudiag.cli import console_main
try:
    console_main()
finally:
    try:
        with open("/proc/self/status") as f:
            print(next(l.split()[1] for l in f if l.startswith("VmHWM:")), file=sys.stderr)
    except (OSError, StopIteration):  # not Linux: ru_maxrss (may include the parent's pages at fork)
        import resource
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
"""


def _events(run_id: str, rank: int, n: int, rng: np.random.Generator) -> pa.Table:
    idx = np.arange(n, dtype=np.int64)
    coll = idx % 5 == 4
    start = 1_700_000_000_000_000_000 + idx * 50_000
    wait = np.where(rank == STRAGGLER, 200_000, 5_000_000)
    dur = np.where(coll, wait + rng.integers(0, 50_000, n), rng.integers(1_000, 40_000, n))
    names = np.where(coll, "gloo:all_reduce", np.array(["aten::addmm", "aten::relu", "aten::mm"])[idx % 3])
    cols: dict[str, Any] = {
        "run_id": [run_id] * n,
        "event_id": idx,
        "source": ["kineto"] * n,
        "process": ["python"] * n,
        "thread": np.where(coll, "gloo", "main").tolist(),
        "name": names.tolist(),
        "category": np.where(coll, "user_annotation", "cpu_op").tolist(),
        "start_ns": start,
        "dur_ns": dur,
        "self_ns": dur,
        "shapes": np.where(coll, "[[4194304]]", "[[32, 128], [128, 128]]").tolist(),
        "dtypes": np.where(coll, '["float"]', '["float", "float"]').tolist(),
        "step": (idx * STEPS // n).tolist(),
    }
    schema = arrow_schema(TraceEvent)
    return pa.table({f.name: cols.get(f.name, pa.nulls(n, f.type)) for f in schema}, schema=schema)


def write_job(run_dir: Path, run_id: str, ranks: int, events: int) -> None:
    rng = np.random.default_rng(0)
    root = run_dir / "shards"
    for rank in range(ranks):
        spool = ShardSpool(root, run_dir / "staging", run_id, rank, attempt=0)
        spool.write_table("trace_events", _events(run_id, rank, events, rng))
        spool.write_records(
            Step, [Step(run_id, s, s * 10_000_000, 9_000_000 + int(rng.integers(0, 500_000)), "optimizer")
                   for s in range(STEPS)]
        )  # fmt: skip
        spool.write_records(
            Fingerprint,
            [Fingerprint(run_id, rank, s, k, f"{s}{k}", tensors=100, abs_sum=1.0)
             for s in range(0, STEPS, 10) for k in ("grad", "param")],
        )  # fmt: skip
        spool.write_records(
            CompileEvent, [CompileEvent(run_id, i, "compile", rank=rank, function="f") for i in range(5)]
        )
        spool.write_records(
            RankInfo,
            [RankInfo(run_id, rank, local_rank=rank % 8, world_size=ranks, host=f"host{rank // 8}", pid=1000 + rank,
                      backend="gloo", status="ok", exit_code=0, started_at=0.0, ended_at=1.0)],
        )  # fmt: skip


def measure(ranks: int, events: int, folder: Path) -> dict[str, Any]:
    store = Store(folder / f"r{ranks}.duckdb")
    run_id = f"job{ranks}"
    run_dir = store.run_dir(run_id)
    t0 = time.perf_counter()
    write_job(run_dir, run_id, ranks, events)
    write_s = time.perf_counter() - t0
    run = Run(id=run_id, name="bench", status="ok", started_at=0.0, artifacts_dir=str(run_dir))
    t0 = time.perf_counter()
    with store.writer() as w:
        run = merge.finish(store, run, run_dir, con=w)
        store.put_run(run, con=w)
    merge_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    section = report_section.build_section(store, {"id": run_id})
    section_s = time.perf_counter() - t0
    assert section is not None
    glob = table_glob(run_dir / "shards", "trace_events")
    t0 = time.perf_counter()
    import duckdb

    with duckdb.connect() as con:
        con.execute(
            f"SELECT rank, count(*), sum(dur_ns) FROM read_parquet('{glob}', hive_partitioning = true) "
            "WHERE name LIKE 'gloo:%' GROUP BY rank"
        ).fetchall()
    glob_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_RSS_MAIN, "report", run_id, "--db", str(store.path), "--json"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    report_s = time.perf_counter() - t0
    peak_kb = int(out.stderr.strip().splitlines()[-1])
    run_row = queries.resolve_run(store, run_id)
    report.build(store, run_row)  # once first: the modules it imports are not the report's data
    tracemalloc.start()
    report.build(store, run_row)
    python_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    stragglers = json.loads(out.stdout)["distributed"]["stragglers"]
    return {
        "ranks": ranks,
        "events": ranks * events,
        "write_shards_s": round(write_s, 3),
        "merge_s": round(merge_s, 3),
        "distributed_section_s": round(section_s, 3),
        "straggler_glob_query_s": round(glob_s, 3),
        "report_cmd_s": round(report_s, 3),
        "report_peak_mb": round(peak_kb / 1024, 1),
        "report_python_peak_mb": round(python_peak / 1e6, 2),
        "straggler_named": bool(stragglers) and stragglers[0]["rank"] == STRAGGLER if ranks > STRAGGLER else None,
    }


def main() -> dict[str, Any]:
    ranks = int(os.environ.get("TPUDIAG_BENCH_RANKS", "256"))
    events = int(os.environ.get("TPUDIAG_BENCH_RANK_EVENTS", "4000"))
    with tempfile.TemporaryDirectory(prefix="tpudiag-bench-dist-") as tmp:
        baseline = measure(1, events, Path(tmp))
        job = measure(ranks, events, Path(tmp))
    return {
        "baseline_1_rank": baseline,
        "job": job,
        "ratios_vs_1_rank": {
            k: round(job[k] / baseline[k], 1) if baseline[k] else None
            for k in ("merge_s", "distributed_section_s", "report_cmd_s", "report_peak_mb", "report_python_peak_mb")
        },
    }
