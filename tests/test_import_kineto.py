"""tpudiag import on real Kineto traces: counts, totals and GPU kernel attribution against a plain JSON pass."""

from __future__ import annotations

import gzip
import json
import os
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.conftest import run_tpudiag
from tpudiag.store import Store, queries
from tpudiag.traces import kineto

GPU_TRACE = "kineto/rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"


def _events(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(gzip.decompress(path.read_bytes()))
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _import(db: Path, *paths: Path) -> str:
    proc = run_tpudiag("import", *map(str, paths), "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    assert "imported from" in proc.stderr
    return proc.stdout.strip()


def test_every_kineto_fixture_imports_with_all_complete_events(shared_fixtures: Path, db: Path) -> None:
    files = sorted((shared_fixtures / "kineto").glob("*.json.gz"))
    run_id = _import(db, shared_fixtures / "kineto")
    expected = {f: sum(1 for e in _events(f) if e.get("ph") == "X") for f in files}
    con = duckdb.connect(str(db), read_only=True)
    total = con.execute("SELECT count(*) FROM trace_events WHERE run_id = ?", [run_id]).fetchone()
    assert total == (sum(expected.values()),)
    # rank comes from distributedInfo (these unrelated jobs are mostly rank 0)
    by_rank = dict(
        con.execute("SELECT rank, count(*) FROM trace_events WHERE run_id = ? GROUP BY rank", [run_id]).fetchall()
    )
    assert by_rank[34] == expected[shared_fixtures / "kineto/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"]
    run = con.execute("SELECT source, status, device_kind FROM runs WHERE id = ?", [run_id]).fetchone()
    assert run == ("import", "ok", "cuda")


def test_gpu_kernels_are_attributed_to_their_launching_cpu_op(shared_fixtures: Path, db: Path) -> None:
    path = shared_fixtures / GPU_TRACE
    evs = _events(path)
    # independent pass: kernel -> launch call (same correlation) -> innermost cpu_op around it on its thread
    launches = {
        e["args"]["correlation"]: e
        for e in evs
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
    }
    launcher: dict[int, str] = {}  # correlation -> innermost cpu_op around the launch call (time sweep per thread)
    per_thread = defaultdict(list)
    for e in evs:
        if e.get("ph") == "X" and (e.get("cat") == "cpu_op" or e.get("cat") in ("cuda_runtime", "cuda_driver")):
            per_thread[(e["pid"], e["tid"])].append(e)
    for items in per_thread.values():
        items.sort(key=lambda e: (e["ts"], e.get("cat") != "cpu_op", -e["dur"]))
        stack: list[dict[str, Any]] = []
        for e in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if e["cat"] == "cpu_op":
                stack.append(e)
                continue
            around = [o for o in stack if o["ts"] + o["dur"] >= e["ts"] + e["dur"]]
            if around:
                launcher[e["args"]["correlation"]] = around[-1]["name"]

    expected: Counter[str] = Counter()
    for e in evs:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            corr = e["args"].get("correlation")
            name = launcher.get(corr) if corr in launches else None
            expected[name or e["name"]] += round(e["dur"] * 1000)
    run_id = _import(db, path)
    ops_out = queries.slow_ops(Store(db), run_id, limit=10, by_module=False)
    assert all(o["time_source"] == "device" for o in ops_out)
    top = expected.most_common(10)
    assert [o["name"] for o in ops_out] == [name for name, _ in top]
    for o, (_, ns) in zip(ops_out, top, strict=True):
        assert o["total_us"] == pytest.approx(ns / 1e3, abs=0.01 * o["calls"])
    con = duckdb.connect(str(db), read_only=True)
    unlinked = con.execute(
        "SELECT count(*) FROM trace_events WHERE run_id = ? AND category = 'kernel' AND launch_id IS NULL", [run_id]
    ).fetchone()
    assert unlinked == (0,)
    # the launch link points at a real host op event of that run
    bad = con.execute(
        """SELECT count(*) FROM trace_events k LEFT JOIN trace_events o
           ON o.run_id = k.run_id AND o.event_id = k.launch_id
           WHERE k.run_id = ? AND k.launch_id IS NOT NULL AND (o.category <> 'cpu_op' OR o.name <> k.framework_op)""",
        [run_id],
    ).fetchone()
    assert bad == (0,)


def test_cpu_only_trace_ranks_by_host_self_time(shared_fixtures: Path, db: Path) -> None:
    path = shared_fixtures / "kineto/rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
    run_id = _import(db, path)
    ops = queries.slow_ops(Store(db), run_id, by_module=False)
    cpu_ops = [e for e in _events(path) if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    assert {o["name"] for o in ops} == {e["name"] for e in cpu_ops}
    assert all(o["time_source"] == "host" for o in ops)
    assert sum(o["calls"] for o in ops) == len(cpu_ops)


def test_load_streams_in_small_chunks_with_the_same_result(shared_fixtures: Path, monkeypatch: Any) -> None:
    path = shared_fixtures / "kineto/sampled_rank-0.json.gz"
    whole = kineto.load(path)
    monkeypatch.setattr(kineto, "READ_CHUNK", 997)  # odd size: boundaries fall inside strings and numbers
    pieces = kineto.load(path)
    assert pieces.columns.equals(whole.columns)
    evs = [e for e in _events(path) if e.get("ph") == "X"]
    assert pieces.columns.column("name").to_pylist() == [e["name"] for e in evs]
    assert pieces.columns.column("dur_ns").to_pylist() == [round(e["dur"] * 1000) for e in evs]


def test_two_process_read_equals_the_in_process_read(shared_fixtures: Path, monkeypatch: Any) -> None:
    """Batches decoded by the forked worker are re-coded into the parent's dictionaries and kept in file order."""
    for name in ("sampled_rank-0.json.gz", "rank-0.Apr_03_18_51_38.1102.pt.trace.json.gz"):
        path = shared_fixtures / "kineto" / name
        whole = kineto.load(path)
        with monkeypatch.context() as m:
            m.setattr(kineto, "PARALLEL_MIN_BYTES", 0)
            m.setattr(kineto, "READ_CHUNK", 4096)  # many batches, so both processes decode some

            def no_fallback(*args: Any) -> None:
                raise AssertionError("the two-process read fell back to the in-process one")

            m.setattr(kineto, "_read", no_fallback)
            shared_work = kineto.load(path, parallel=True)
        assert shared_work.columns.to_pylist() == whole.columns.to_pylist()
        assert (shared_work.process_names, shared_work.thread_names) == (whole.process_names, whole.thread_names)
        assert (shared_work.metadata, shared_work.rank) == (whole.metadata, whole.rank)


def test_a_failing_or_dying_decode_worker_is_reported() -> None:
    from tpudiag.traces.decodepool import DecodeWorker, WorkerError

    with DecodeWorker(lambda b: int(b)) as worker:
        worker.submit(b"41")
        assert worker.result() == 41
        worker.submit(b"not a number")
        with pytest.raises(WorkerError, match="ValueError"):
            worker.result()
    with DecodeWorker(lambda b: os._exit(3)) as worker:
        worker.submit(b"x")
        with pytest.raises(WorkerError, match="died"):
            worker.result()


def test_import_command_never_loads_pandas(tmp_path: Path) -> None:
    """pyarrow pulls pandas in (~0.6 s) on its first array unless the import command keeps it out."""
    import subprocess
    import sys

    from tests.conftest import REPO

    code = (
        "import sys\n"
        "from tpudiag.cli import main\n"
        "rc = main(['import', sys.argv[1], '--db', sys.argv[2]])\n"
        "print(rc, 'pandas' in sys.modules)\n"
    )
    sample = REPO / "sample_traces" / "cpu_mlp.trace.json.gz"
    db = tmp_path / "s.duckdb"
    proc = subprocess.run([sys.executable, "-c", code, str(sample), str(db)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["0", "False"], proc.stdout
    assert queries.list_runs(Store(db))  # and the import really happened
