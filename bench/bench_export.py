"""Export speed on a 1 M-event run: tensorboard (XPlane), perfetto (Chrome JSON, plain and gzip), parquet.

Anchor, measured in the same run: reading the run's trace_events out of DuckDB into one Arrow table (the least
any exporter has to do).  Target: each export of 1 M events in at most a few seconds.

    python -m bench.run export            # TPUDIAG_BENCH_EVENTS=200000 for a quicker look
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from tpudiag.exporters import ExportOptions, load_exporter
from tpudiag.model import TraceEvent, arrow_schema
from tpudiag.spool import Spool
from tpudiag.store import Store, export_queries, queries

OPS = ("aten::addmm", "aten::relu", "aten::mm", "aten::add_", "aten::native_layer_norm", "aten::gelu")
MODULES = ("blocks.0.fc", "blocks.0.act", "blocks.1.fc", "blocks.1.norm", "head", None)


def synthetic_events(run_id: str, n: int, seed: int = 0) -> pa.Table:
    """``n`` host op events on 4 threads: pairs of (parent op, nested child op), realistic names, shapes."""
    rng = np.random.default_rng(seed)
    idx = np.arange(n, dtype=np.int64)
    pair = idx // 2
    start = 1_700_000_000_000_000_000 + pair * 10_000 + (idx % 2) * 1_000
    dur = np.where(idx % 2 == 0, 8_000, rng.integers(500, 6_000, n))
    self_ns = np.where(idx % 2 == 0, dur - np.roll(dur, -1), dur)
    cols: dict[str, Any] = {
        "run_id": [run_id] * n,
        "event_id": idx,
        "source": ["kineto"] * n,
        "process": ["python"] * n,
        "thread": [f"thread {t}" for t in (pair % 4)],
        "name": [OPS[i] for i in rng.integers(0, len(OPS), n)],
        "category": ["cpu_op"] * n,
        "start_ns": start,
        "dur_ns": dur,
        "self_ns": self_ns,
        "depth": idx % 2,
        "module": [MODULES[i] for i in rng.integers(0, len(MODULES), n)],
        "shapes": ["[[32,128],[128,128]]"] * n,
        "step": pair // 5_000,
        "external_id": idx,
        "rank": np.zeros(n, dtype=np.int64),
        "on_device": np.zeros(n, dtype=bool),
    }
    schema = arrow_schema(TraceEvent)
    arrays = [pa.array(cols[f.name], type=f.type) if f.name in cols else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=schema)


def build_store(path: Path, n: int) -> dict[str, Any]:
    from tests.factories import make_run

    store = Store(path)
    run = make_run(id="bench-export", name="bench")
    store.put_run(run)
    spool = Spool(store.run_dir(run.id) / "spool")
    chunk = 250_000
    for lo in range(0, n, chunk):
        table = synthetic_events(run.id, min(chunk, n - lo), seed=lo)
        table = table.set_column(1, "event_id", pa.array(np.arange(lo, lo + table.num_rows), pa.int64()))
        spool.write_table("trace_events", table)
    store.ingest_spool(run.id, spool.directory)
    return queries.resolve_run(store, run.id)


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> dict[str, Any]:
    n = int(os.environ.get("TPUDIAG_BENCH_EVENTS", "1000000"))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        store = Store(root / "bench.duckdb")
        run = build_store(store.path, n)

        def read_arrow() -> None:
            with store.reader() as con:
                export_queries.table_batches(con, "trace_events", run["id"]).read_all()

        anchor = min(_timed(read_arrow) for _ in range(2))
        results: dict[str, Any] = {"events": n, "anchor_read_arrow_s": round(anchor, 3)}
        for label, fmt, options in (
            ("parquet", "parquet", ExportOptions()),
            ("perfetto", "perfetto", ExportOptions()),
            ("perfetto_gzip", "perfetto", ExportOptions(gzip=True)),
            ("tensorboard", "tensorboard", ExportOptions()),
        ):
            out = root / label
            exporter = load_exporter(fmt)
            seconds = _timed(lambda e=exporter, o=out, opt=options: e.export(store, run, o, opt))
            size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
            results[f"{label}_s"] = round(seconds, 3)
            results[f"{label}_events_per_s"] = round(n / seconds)
            results[f"{label}_vs_anchor"] = round(seconds / anchor, 2)
            results[f"{label}_mb"] = round(size / 1e6, 1)
    return results


if __name__ == "__main__":
    print(main())
