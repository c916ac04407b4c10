"""Perfetto / Chrome trace export, read back by an independent reader: a strict JSON-schema check (the
trace processor of the ``perfetto`` package downloads a binary, which does not work offline) plus exact counts
and times.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import pytest

from tests.factories import make_event, make_run, make_step, store_with
from tpudiag.cli import main
from tpudiag.model import OpDiff, OpRecord, Step, TraceEvent
from tpudiag.store import Store

_NUM = {"type": "number", "minimum": 0}
_INT = {"type": "integer", "minimum": 0}
EVENT_SCHEMA: dict[str, Any] = {
    "oneOf": [
        {
            "type": "object",
            "properties": {
                "ph": {"const": "X"}, "name": {"type": "string"}, "cat": {"type": "string"}, "pid": _INT,
                "tid": _INT, "ts": _NUM, "dur": _NUM, "args": {"type": "object"},
            },
            "required": ["ph", "name", "cat", "pid", "tid", "ts", "dur", "args"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "ph": {"const": "M"},
                "name": {"enum": ["process_name", "thread_name", "process_sort_index", "thread_sort_index"]},
                "pid": _INT, "tid": _INT,
                "args": {"type": "object", "minProperties": 1, "maxProperties": 1},
            },
            "required": ["ph", "name", "pid", "tid", "args"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {
                "ph": {"enum": ["s", "f"]}, "name": {"type": "string"}, "cat": {"type": "string"}, "id": _INT,
                "pid": _INT, "tid": _INT, "ts": _NUM, "bp": {"const": "e"},
            },
            "required": ["ph", "name", "cat", "id", "pid", "tid", "ts"],
            "additionalProperties": False,
        },
    ]
}  # fmt: skip
TRACE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "displayTimeUnit": {"enum": ["ms", "ns"]},
        "otherData": {"type": "object"},
        "traceEvents": {"type": "array", "items": EVENT_SCHEMA},
    },
    "required": ["traceEvents"],
    "additionalProperties": False,
}


def _fill(store: Store) -> tuple[str, list[TraceEvent]]:
    run = make_run(device_kind="cuda")
    t0 = 1_700_000_000_123_456_789
    events: list[TraceEvent] = []
    for i in range(40):
        start = t0 + i * 10_007
        module = "blocks.0.fc" if i % 2 else "head"
        events.append(
            make_event(
                run.id,
                2 * i,
                "aten::addmm",
                start,
                5_003,
                self_ns=4_001,
                module=module,
                shapes=json.dumps([[8, 16], [16, 4]]),
                step=i // 10,
                correlation=1000 + i,
                thread="main",
                process="python",
            )
        )
        # Device work: even ones linked by launch_id, odd ones only by the shared correlation id.
        events.append(
            make_event(
                run.id,
                2 * i + 1,
                "gemm_kernel",
                start + 2_500,
                3_333,
                on_device=True,
                category="kernel",
                process="GPU 0",
                thread="stream 7",
                correlation=1000 + i,
                launch_id=2 * i if i % 2 == 0 else None,
            )
        )
    events.append(
        make_event(
            run.id,
            100,
            'weird "name"\n',
            t0 + 1,
            1,
            category="user_annotation",
            thread="main",
            process="python",
        )
    )
    ops = [OpRecord(run_id=run.id, seq=k, op="aten.addmm.default", module="head") for k in range(3)]
    diffs = [
        OpDiff(run_id=run.id, seq=k, output_index=0, verdict="fail" if k == 1 else "pass", scaled_error=9.0)
        for k in range(3)
    ]
    steps = [make_step(run.id, k, t0 + k * 100_070, 100_000) for k in range(4)]
    store_with(store, run, {TraceEvent: events, OpRecord: ops, OpDiff: diffs, Step: steps})
    return run.id, events  # fmt: skip


@pytest.mark.parametrize("gz", [False, True])
def test_perfetto_export_is_valid_and_exact(db: Path, tmp_path: Path, gz: bool,
                                            capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    store = Store(db)
    run_id, events = _fill(store)
    argv = ["export", run_id, "--db", str(db), "--format", "perfetto", "--out", str(tmp_path / "o")]
    assert main([*argv, "--gzip"] if gz else argv) == 0
    [path] = [Path(p) for p in capsys.readouterr().out.split()]
    assert path.name.endswith(".trace.json.gz" if gz else ".trace.json")
    raw = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
    trace = json.loads(raw)
    jsonschema.validate(trace, TRACE_SCHEMA, cls=jsonschema.Draft202012Validator)

    origin = trace["otherData"]["origin_epoch_ns"]
    assert origin == min(e.start_ns for e in events)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(events)
    assert sorted(round(e["dur"] * 1000) for e in complete) == sorted(e.dur_ns for e in events)
    assert sorted(round(e["ts"] * 1000) + origin for e in complete) == sorted(e.start_ns for e in events)

    names = {(m["pid"], m.get("tid")): m["args"]["name"] for m in trace["traceEvents"] if m["ph"] == "M"
             and m["name"] in ("process_name", "thread_name")}  # fmt: skip
    kernels = [e for e in complete if e["name"] == "gemm_kernel"]
    ops = [e for e in complete if e["name"] == "aten::addmm"]
    assert names[(kernels[0]["pid"], 0)] == "rank 0: GPU 0 (device)"
    assert names[(kernels[0]["pid"], kernels[0]["tid"])] == "stream 7"
    assert names[(ops[0]["pid"], ops[0]["tid"])] == "main"
    assert any(e["name"] == 'weird "name"\n' for e in complete)

    head = [e for e in ops if e["args"]["module"] == "head"]
    assert head and all(e["args"]["numerics_verdict"] == "fail" for e in head)
    assert all("numerics_verdict" not in e["args"] for e in ops if e["args"]["module"] != "head")
    assert ops[0]["args"]["shapes"] == [[8, 16], [16, 4]] and ops[0]["args"]["self_us"] == 4.001
    assert {e["args"]["step"] for e in ops} == {0, 1, 2, 3}

    starts = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "s"}
    finishes = {e["id"]: e for e in trace["traceEvents"] if e["ph"] == "f"}
    assert len(starts) == len(finishes) == 40 and starts.keys() == finishes.keys()
    for fid, s in starts.items():
        f = finishes[fid]
        assert (s["pid"], s["tid"]) == (ops[0]["pid"], ops[0]["tid"])
        assert (f["pid"], f["tid"]) == (kernels[0]["pid"], kernels[0]["tid"])
        # The flow leaves the host op at its start and lands on the kernel 2.5 us later.
        assert f["ts"] - s["ts"] == pytest.approx(2.5, abs=1e-6)


def test_empty_run_exports_valid_trace(db: Path, tmp_path: Path) -> None:
    store = Store(db)
    run = make_run()
    store_with(store, run, {})
    assert main(["export", run.id, "--db", str(db), "--format", "perfetto", "--out", str(tmp_path)]) == 0
    trace = json.loads(next(tmp_path.glob("*.trace.json")).read_text())
    jsonschema.validate(trace, TRACE_SCHEMA)
    assert trace["traceEvents"] == []
