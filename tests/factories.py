"""Hand-built records for testing consumers (store, report, exporters, dashboard) without a live capture."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pyarrow as pa

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
