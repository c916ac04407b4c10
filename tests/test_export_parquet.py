"""Parquet export: files round-trip into a fresh DuckDB with the same aggregates; bad input fails cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_tpudiag
from tests.factories import make_event, make_run, make_step, store_with
from tpudiag.cli import main
from tpudiag.exporters.parquet_export import read_schema_version
from tpudiag.model import OpDiff, OpRecord, Step, TraceEvent
from tpudiag.store import SCHEMA_VERSION, Store, export_queries

AGGREGATES = {
    "trace_events": "SELECT count(*), sum(dur_ns), sum(self_ns), count(DISTINCT name), "
    "sum(coalesce(step, -1)) FROM {src}",
    "steps": "SELECT count(*), sum(dur_ns), max(step) FROM {src}",
    "ops": "SELECT count(*), sum(seq), count(module) FROM {src}",
    "op_diffs": "SELECT count(*), sum(max_abs), count(*) FILTER (WHERE verdict = 'fail') FROM {src}",
    "runs": "SELECT count(*), min(id), max(duration_s), max(argv) FROM {src}",
}


def _fill(store: Store, n_events: int = 500) -> str:
    run = make_run(argv=["--lr", "0.1"])
    events = [
        make_event(run.id, i, f"aten::op{i % 7}", 1_000_000 + i * 1_000, 900 - i % 50, step=i // 100,
                   module=None if i % 3 else "blocks.0", shapes=json.dumps([[i % 4, 8]]))
        for i in range(n_events)
    ]  # fmt: skip
    ops = [OpRecord(run_id=run.id, seq=i, op="aten.mm.default", module="blocks.0") for i in range(5)]
    diffs = [OpDiff(run_id=run.id, seq=i, output_index=0, verdict="fail" if i == 2 else "pass",
                    max_abs=0.5 * i) for i in range(5)]  # fmt: skip
    steps = [make_step(run.id, k, 1_000_000 + k * 100_000, 99_000) for k in range(5)]
    store_with(store, run, {TraceEvent: events, Step: steps, OpRecord: ops, OpDiff: diffs})
    # A second run in the same store must not leak into the export.
    other = make_run()
    store_with(store, other, {TraceEvent: [make_event(other.id, 0, "aten::zzz", 5, 5)]})
    return run.id


def test_parquet_round_trip_gives_same_aggregates(db: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = Store(db)
    run_id = _fill(store)
    out = tmp_path / "pq"
    assert main(["export", run_id, "--db", str(db), "--format", "parquet", "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    # Every table of a run, the memory and long-run ones too (empty here), one file each.
    assert sorted(Path(p).name for p in printed) == sorted(f"{t}.parquet" for t in export_queries.RUN_TABLES)
    assert {"runs", "trace_events", "steps", "ops", "op_diffs", "compile_events"} <= set(export_queries.RUN_TABLES)
    fresh = duckdb.connect(str(tmp_path / "fresh.duckdb"))
    with store.reader() as con:
        for table, sql in AGGREGATES.items():
            key = "id" if table == "runs" else "run_id"
            fresh.execute(f"CREATE TABLE {table} AS SELECT * FROM read_parquet(?)", [str(out / f"{table}.parquet")])
            got = fresh.execute(sql.format(src=table)).fetchall()
            want = con.execute(sql.format(src=f"(SELECT * FROM {table} WHERE {key} = ?)"), [run_id]).fetchall()
            assert got == want, table
            assert got[0][0] > 0
    # Same column names and types as the store.
    with store.reader() as con:
        store_cols = con.execute("DESCRIBE trace_events").fetchall()
    assert fresh.execute("DESCRIBE trace_events").fetchall() == store_cols
    assert fresh.execute("SELECT count(*) FROM read_parquet(?)", [str(out / "compile_events.parquet")]).fetchall() == [
        (0,)
    ]
    assert read_schema_version(out / "trace_events.parquet") == SCHEMA_VERSION
    meta = pq.read_schema(out / "runs.parquet").metadata
    assert meta[b"tpudiag.table"] == b"runs" and meta[b"tpudiag.run_id"] == run_id.encode()
    # pandas reads them too (what Spark and BigQuery see is the same Parquet schema).
    frame = pq.read_table(out / "steps.parquet").to_pandas()
    assert list(frame["step"]) == [0, 1, 2, 3, 4]
    assert not list(out.glob(".*tmp"))


def test_export_errors_are_one_line(db: Path, tmp_path: Path) -> None:
    store = Store(db)
    _fill(store, n_events=3)
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    o = str(tmp_path / "o")
    cases = [
        (["export", "nope", "--db", str(db), "--format", "parquet", "--out", o], 5, "no run"),
        (["export", "--db", str(db), "--format", "parquet", "--out", str(a_file)], 2, "not a directory"),
        (["export", "--db", str(tmp_path / "none.duckdb"), "--format", "parquet", "--out", o], 3, "no store"),
        (["export", "--db", str(db), "--format", "bogus", "--out", o], 2, "invalid choice"),
        (["export", "--db", str(a_file), "--format", "parquet", "--out", o], 3, "not a tpudiag"),
    ]
    for argv, code, text in cases:
        proc = run_tpudiag(*argv)
        assert proc.returncode == code, (argv, proc.stderr)
        assert text in proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())
