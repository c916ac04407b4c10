"""Hand-built records for testing consumers (store, report, exporters, dashboard) without a live capture."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pyarrow as pa

from tpudiag.comparison.snapshot import Snapshot
from tpudiag.model import Run, Step, TraceEvent, arrow_schema, records_to_arrow
from tpudiag.spool import Spool
from tpudiag.store import Store

_ids = itertools.count()


def make_run(**overrides: Any) -> Run:
    n = next(_ids)
    fields: dict[str, Any] = {
        "id": f"run-{n:04d}",
        "name": f"run{n}",
        "status": "ok",
        "started_at": 1_700_000_000.0 + n,
        "exit_code": 0,
        "script": "train.py",
        "argv": ["--epochs", "1"],
        "cwd": "/tmp",
        "duration_s": 1.5,
        "host": "testhost",
        "pid": 1,
        "device_kind": "cpu",
        "device_name": "x86_64",
        "torch_version": "2.13.0",
    }
    fields.update(overrides)
    return Run(**fields)


def make_event(run_id: str, event_id: int, name: str, start_ns: int, dur_ns: int, **kw: Any) -> TraceEvent:
    fields: dict[str, Any] = {
        "run_id": run_id,
        "event_id": event_id,
        "source": "kineto",
        "process": "1",
        "thread": "1",
        "name": name,
        "category": "cpu_op",
        "start_ns": start_ns,
        "dur_ns": dur_ns,
        "self_ns": dur_ns,
    }
    fields.update(kw)
    return TraceEvent(**fields)


def make_step(run_id: str, step: int, start_ns: int, dur_ns: int, **kw: Any) -> Step:
    return Step(
        run_id=run_id,
        step=step,
        start_ns=start_ns,
        dur_ns=dur_ns,
        kind=kw.pop("kind", "optimizer"),
        input_shapes=kw.pop("input_shapes", json.dumps([[4, 8]])),
        **kw,
    )


def store_with(store: Store, run: Run, tables: dict[type[Any], list[Any]]) -> None:
    """Write a run and its records through the real spool + ingest path."""
    store.put_run(run)
    spool = Spool(store.run_dir(run.id) / "spool")
    for cls, records in tables.items():
        spool.write_table(cls.TABLE, records_to_arrow(cls, records))
    with store.writer() as w:
        store.finish_run(run.id, spool.directory, con=w)


def empty_table(cls: type[Any]) -> pa.Table:
    return arrow_schema(cls).empty_table()


def make_snapshot(
    step_s: float = 0.05,
    steps: int = 40,
    shapes: tuple[list[list[int]], ...] = ([[4, 8]],),
    recompiles: list[dict[str, Any]] | None = None,
    **run: Any,
) -> Snapshot:
    """A run reduced for comparison: ``steps`` optimizer steps of about ``step_s`` seconds (±2%) whose model inputs
    have the shapes of ``shapes`` (one entry a step, cycled), and a compile section with ``recompiles`` (events as
    ``comparison.source`` builds them: function, file, line, reason, step_index)."""
    events = list(recompiles or [])
    return Snapshot(
        run={"id": run.pop("id", "snap"), "name": run.pop("name", "snap"), "script": "train.py", "argv": [], **run},
        steps=[
            {
                "step": i,
                "dur_ns": int(step_s * (0.98 + 0.01 * (i % 5)) * 1e9),
                "kind": "optimizer",
                "input_shapes": json.dumps(shapes[i % len(shapes)]),
            }
            for i in range(steps)
        ],
        time_source="host",
        numerics=[],
        compile={
            "compiles": 1 + len(events),
            "recompiles": len(events),
            "graph_breaks": 0,
            "cache_hits": 0,
            "cache_misses": 1 + len(events),
            "compile_time_s": 0.5,
            "recompile_reasons": sorted({str(e.get("reason")) for e in events}),
            "recompile_events": events,
            "graph_break_sites": [],
        },
    )
