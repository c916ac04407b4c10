"""The store: schema and versioning, refusal of foreign files, spooled ingest, concurrency, crash safety."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from tests.factories import make_event, make_run, make_step, store_with
from tpudiag.errors import StoreError, StoreLockedError, UnknownRunError
from tpudiag.model import Step, TraceEvent, records_to_arrow
from tpudiag.spool import Spool
from tpudiag.store import SCHEMA_VERSION, Store, queries


def test_new_store_has_current_schema_version(db: Path) -> None:
    store = Store(db)
    store.put_run(make_run())
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (str(SCHEMA_VERSION),)
    tables = {r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()}
    con.close()
    assert {"runs", "trace_events", "steps", "ops", "op_diffs", "compile_events"} <= tables


def test_store_from_newer_schema_is_refused(db: Path) -> None:
    Store(db).put_run(make_run())
    con = duckdb.connect(str(db))
    con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(SCHEMA_VERSION + 1)])
    con.close()
    with pytest.raises(StoreError, match="newer tpudiag"):
        queries.list_runs(Store(db))
    with pytest.raises(StoreError, match="newer tpudiag"):
        Store(db).put_run(make_run())


def test_corrupt_file_and_directory_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.duckdb"
    bad.write_bytes(os.urandom(4096))
    with pytest.raises(StoreError, match="not a tpudiag store"):
        queries.list_runs(Store(bad))
    with pytest.raises(StoreError, match="directory"):
        Store(tmp_path)


def test_foreign_duckdb_file_is_not_written(tmp_path: Path) -> None:
    other = tmp_path / "other.duckdb"
    con = duckdb.connect(str(other))
    con.execute("CREATE TABLE users (id INT)")
    con.close()
    with pytest.raises(StoreError, match="not a tpudiag store"):
        Store(other).put_run(make_run())
    con = duckdb.connect(str(other), read_only=True)
    tables = [r[0] for r in con.execute("SELECT table_name FROM information_schema.tables").fetchall()]
    con.close()
    assert tables == ["users"]


def test_ingest_loads_each_part_once_and_removes_it(db: Path) -> None:
    store = Store(db)
    run = make_run()
    store.put_run(run)
    spool = Spool(store.run_dir(run.id) / "spool")
    events = [make_event(run.id, i, "aten::mm", i * 100, 50) for i in range(10)]
    part = spool.write_table("trace_events", records_to_arrow(TraceEvent, events))
    assert part is not None and part.exists()
    assert store.ingest_spool(run.id, spool.directory) == 10
    assert not part.exists()
    # A crash between commit and unlink leaves the part on disk: loading it again must not duplicate rows.
    part2 = spool.write_table("trace_events", records_to_arrow(TraceEvent, events[:3]))
    assert part2 is not None
    with store.writer() as w:
        w.execute("INSERT INTO ingested_parts VALUES (?, ?, NULL)", [run.id, f"trace_events/{part2.name}"])
    assert store.ingest_spool(run.id, spool.directory) == 0
    assert not part2.exists()
    assert queries.trace_counts(store, run.id) == {"cpu_op": 10}


def test_resolve_run_by_id_name_prefix_and_latest(db: Path) -> None:
    store = Store(db)
    a = make_run(name="alpha", started_at=1.0)
    b = make_run(name="beta", started_at=2.0)
    c = make_run(name="beta", started_at=3.0)
    for r in (a, b, c):
        store.put_run(r)
    assert queries.resolve_run(store, None)["id"] == c.id
    assert queries.resolve_run(store, "alpha")["id"] == a.id
    assert queries.resolve_run(store, b.id)["id"] == b.id
    with pytest.raises(UnknownRunError, match="matches 2 runs"):
        queries.resolve_run(store, "beta")
    with pytest.raises(UnknownRunError, match="no run"):
        queries.resolve_run(store, "gamma")
    assert [r["id"] for r in queries.list_runs(store)] == [c.id, b.id, a.id]


def test_slow_ops_ranks_by_self_time_and_groups_by_module(db: Path) -> None:
    store = Store(db)
    run = make_run()
    ev = [
        make_event(run.id, 0, "aten::mm", 0, 100, self_ns=90, module="fc1"),
        make_event(run.id, 1, "aten::mm", 200, 100, self_ns=80, module="fc1"),
        make_event(run.id, 2, "aten::relu", 400, 500, self_ns=500, module="act"),
        make_event(run.id, 3, "module::fc1", 0, 1000, self_ns=10, category="user_annotation"),
    ]
    store_with(store, run, {TraceEvent: ev, Step: [make_step(run.id, 0, 0, 1000)]})
    ops = queries.slow_ops(store, run.id)
    assert [(o["name"], o["module"], o["calls"]) for o in ops] == [
        ("aten::relu", "act", 1),
        ("aten::mm", "fc1", 2),
    ]
    assert ops[1]["self_us"] == pytest.approx(0.17)
    assert ops[1]["total_us"] == pytest.approx(0.2)
    assert all(o["time_source"] == "host" for o in ops)


def _hold_writer(db: str, seconds: float, ready: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    con = duckdb.connect(db)
    ready.set()
    time.sleep(seconds)
    con.close()


def test_writer_waits_for_lock_then_lands(db: Path) -> None:
    Store(db).put_run(make_run())
    ready = multiprocessing.get_context("spawn").Event()
    holder = multiprocessing.get_context("spawn").Process(target=_hold_writer, args=(str(db), 1.5, ready))
    holder.start()
    assert ready.wait(30)
    t0 = time.monotonic()
    Store(db, lock_timeout_s=30).put_run(make_run(name="late"))
    waited = time.monotonic() - t0
    holder.join()
    assert waited > 0.5  # it really waited for the other process
    assert "late" in [r["name"] for r in queries.list_runs(Store(db))]


def test_lock_held_past_the_window_is_a_clear_error(db: Path) -> None:
    Store(db).put_run(make_run())
    ready = multiprocessing.get_context("spawn").Event()
    holder = multiprocessing.get_context("spawn").Process(target=_hold_writer, args=(str(db), 4, ready))
    holder.start()
    assert ready.wait(30)
    try:
        with pytest.raises(StoreLockedError, match="stayed locked"):
            Store(db, lock_timeout_s=0.5).put_run(make_run())
    finally:
        holder.join()


def test_sigkill_during_a_write_never_corrupts_the_store(db: Path, tmp_path: Path) -> None:
    """A process killed mid-transaction leaves the store readable with every committed run intact."""
    store = Store(db)
    for _ in range(3):
        store.put_run(make_run())
    script = tmp_path / "writer.py"
    script.write_text(
        "import sys, time\n"
        "from tpudiag.store import Store\n"
        "from tpudiag.model import TraceEvent, records_to_arrow\n"
        "from tests.factories import make_event, make_run\n"
        "s = Store(sys.argv[1]); r = make_run(id='killed'); s.put_run(r)\n"
        "evs = [make_event('killed', i, 'aten::add', i, 1) for i in range(200000)]\n"
        "t = records_to_arrow(TraceEvent, evs)\n"
        "print('ready', flush=True)\n"
        "while True:\n"
        "    with s.writer() as w:\n"
        "        w.register('t', t); w.execute('INSERT INTO trace_events SELECT * FROM t')\n"
        "    print('committed', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script), str(db)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])},
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    assert proc.stdout.readline().strip() == "committed"  # one whole batch is in; kill during a later one
    time.sleep(0.3)
    proc.kill()
    proc.wait()
    runs = queries.list_runs(Store(db))
    assert len(runs) == 4
    with Store(db).reader() as r:
        (rows,) = r.execute("SELECT count(*) FROM trace_events").fetchone()
    assert rows >= 200000 and rows % 200000 == 0, rows  # the committed batches, whole; the killed one not at all


def test_op_summary_gives_the_same_slow_ops_as_the_raw_events(db: Path) -> None:
    store = Store(db)
    run = make_run()
    ev = [
        make_event(run.id, i, name, i * 10, 5 + i % 7, self_ns=3 + i % 5, module=mod, phase=phase)
        for i, (name, mod, phase) in enumerate(
            [("aten::mm", "fc1", "forward"), ("aten::mm", "fc2", "backward"), ("aten::relu", "act", "forward")] * 50
        )
    ]
    store_with(store, run, {TraceEvent: ev})
    summarized = queries.slow_ops(store, run.id)
    with store.writer() as w:
        w.execute("DELETE FROM op_summary WHERE run_id = ?", [run.id])
    raw = queries.slow_ops(store, run.id)
    assert summarized == raw
    assert sum(o["calls"] for o in raw) == 150
