"""The structured-trace interpretation, the TORCH_TRACE reader and the compile report, on hand-built records.

Record shapes (metadata keys, payload texts) are the ones torch 2.13 emits, copied from a real trace; the real
compiles are exercised in test_compile_capture.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.factories import make_run, store_with
from tpudiag.analysis.compile_events import CompileEventBuilder
from tpudiag.analysis.compile_text import parse_graph_break, recompile_reasons
from tpudiag.compile_report import build_section, render_section, summarize
from tpudiag.errors import ImportFormatError
from tpudiag.model import CompileEvent
from tpudiag.store import Store
from tpudiag.traces.torch_trace import is_torch_trace, read_torch_trace

GRAPH_BREAK = """Graph break in user code at /w/demo.py:16
Graph Break Reason: Encountered graph break when attempting to trace CALL: a function call, e.g. f(x, y):

Failed to trace builtin operator
  Explanation: Dynamo does not know how to trace builtin operator `print` with argument types ['str']
  Hint: Avoid calling builtin `print` with argument types ['str'].

User code traceback:
  File "/w/demo.py", line 20, in <module>
    cf(torch.randn(4))
  File "/w/demo.py", line 16, in f
    print("break")

Traceback (most recent call last):
  File "/site-packages/torch/_dynamo/symbolic_convert.py", line 1076, in wrapper
    return inner_fn(self, inst)
"""


def ids(frame: int, n: int, attempt: int = 0) -> dict[str, Any]:
    return {"frame_id": frame, "frame_compile_id": n, "attempt": attempt}


def metrics(frame: int, n: int, **kw: Any) -> dict[str, Any]:
    m = {
        "compile_id": f"{frame}/{n}",
        "co_name": "f",
        "co_filename": "/w/demo.py",
        "co_firstlineno": 14,
        "start_time": 1_700_000_000.5,
        "entire_frame_compile_time_s": 2.5,
        "fail_type": None,
        "fail_reason": None,
        "recompile_reason": None,
        "restart_reasons": [],
    }
    m.update(kw)
    return {"compilation_metrics": m, **ids(frame, n)}


def tensor_records(frame: int, n: int, size: list[int], source: str = "L['x']") -> list[tuple[dict[str, Any], None]]:
    return [
        ({"describe_tensor": {"id": 0, "describer_id": n, "size": size}, **ids(frame, n)}, None),
        ({"describe_source": {"id": 0, "describer_id": n, "source": source}, **ids(frame, n)}, None),
        ({"describe_tensor": {"id": 1, "describer_id": n, "size": [16, 8]}, **ids(frame, n)}, None),
        (
            {
                "describe_source": {"id": 1, "describer_id": n, "source": "L['self']._parameters['w']"},
                **ids(frame, n),
            },
            None,
        ),
    ]


def compile_records() -> list[tuple[dict[str, Any], str | None]]:
    """One frame compiled twice (the second for a size change), with a graph break and cache lookups."""
    recs: list[tuple[dict[str, Any], str | None]] = [
        ({"str": ["/w/demo.py", 1]}, None),
        ({"dynamo_start": {"stack": [{"line": 14, "name": "f", "filename": 1}]}, **ids(0, 0)}, None),
        *tensor_records(0, 0, [4]),
        ({"artifact": {"name": "dynamo_graph_break_reason", "encoding": "string"}, **ids(0, 0)}, GRAPH_BREAK),
        (
            {"artifact": {"name": "fx_graph_cache_miss", "encoding": "json"}, **ids(0, 0, 1)},
            json.dumps({"cache_status_detailed": "miss", "key": "k1", "components": ["x" * 100]}),
        ),
        (
            {"artifact": {"name": "aotautograd_cache_hit", "encoding": "json"}, **ids(0, 0, 1)},
            json.dumps({"cache_status_detailed": "hit", "time_saved_ms": 27.0}),
        ),
        (metrics(0, 0), None),
        (
            {"artifact": {"name": "recompile_reasons", "encoding": "json"}, **ids(0, 1)},
            "0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8",
        ),
        ({"dynamo_start": {"stack": [{"line": 14, "name": "f", "filename": 1}]}, **ids(0, 1)}, None),
        *tensor_records(0, 1, [8]),
        (
            {"artifact": {"name": "fx_graph_cache_bypass", "encoding": "json"}, **ids(0, 1)},
            json.dumps({"cache_bypass_reason": "unsupported op", "cache_state": "bypass"}),
        ),
        (
            metrics(
                0,
                1,
                recompile_reason="0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8",
                entire_frame_compile_time_s=1.5,
            ),
            None,
        ),
    ]
    return recs


def run_builder(records: Sequence[tuple[dict[str, Any], str | None]], run_id: str = "r") -> list[CompileEvent]:
    b = CompileEventBuilder(run_id)
    out: list[CompileEvent] = []
    for i, (meta, payload) in enumerate(records):
        out += b.feed(meta, payload, 1000 + i)
    return out + b.finish()


def test_empty_in_empty_out() -> None:
    assert run_builder([]) == []
    section = summarize([])
    assert section["compiles"] == 0 and section["by_frame"] == [] and section["tpu_cache"] is None


def test_compile_recompile_graph_break_and_caches() -> None:
    events = run_builder(compile_records())
    kinds = [e.kind for e in events]
    assert kinds == ["graph_break", "cache", "cache", "compile", "cache", "recompile"]
    assert [e.seq for e in events] == list(range(6))
    gb = events[0]
    assert (gb.file, gb.line, gb.function) == ("/w/demo.py", 16, "f")
    assert (gb.reason or "").startswith("Failed to trace builtin operator: Dynamo does not know how to trace builtin")
    fx, aot = events[1], events[2]
    assert (fx.cache_tier, fx.cache_hit, aot.cache_tier, aot.cache_hit) == (
        "inductor_fx",
        False,
        "aotautograd",
        True,
    )
    assert (fx.function, fx.line) == ("f", 14)  # cache events carry the frame of their compilation
    assert "components" not in json.loads(fx.payload or "{}")
    bypass = events[4]
    assert (bypass.cache_hit, bypass.reason) == (None, "unsupported op")
    first, again = events[3], events[5]
    assert (first.compile_id, first.duration_s, json.loads(first.shapes or "")) == ("0/0", 2.5, {"x": [4]})
    assert again.reason == "tensor 'x' size mismatch at index 0. expected 4, actual 8"
    assert json.loads(again.shapes or "") == {"x": [8]}  # parameters are not inputs


def test_failed_compile_drops_its_graph_break_and_records_the_failure() -> None:
    recs = [
        ({"dynamo_start": {"stack": []}, **ids(2, 0)}, None),
        ({"artifact": {"name": "dynamo_graph_break_reason", "encoding": "string"}, **ids(2, 0)}, GRAPH_BREAK),
        (metrics(2, 0, fail_type="Unsupported", fail_reason="Observed exception\n  Explanation: ..."), None),
    ]
    events = run_builder(recs)
    assert [(e.kind, e.failed, e.reason) for e in events] == [("compile", True, "Unsupported: Observed exception")]


def test_torch_wrapper_frame_is_named_by_the_user_call_site() -> None:
    wrapper = "/venv/lib/python3.11/site-packages/torch/_dynamo/external_utils.py"
    recs = [
        ({"str": ["/w/train.py", 1]}, None),
        ({"str": [wrapper, 2]}, None),
        (
            {
                "dynamo_start": {
                    "stack": [
                        {"line": 20, "name": "<module>", "filename": 1},
                        {"line": 67, "name": "inner", "filename": 2},
                    ]
                },
                **ids(0, 0),
            },
            None,
        ),
        (metrics(0, 0, co_name="inner", co_filename=wrapper, co_firstlineno=67), None),
    ]
    (event,) = run_builder(recs)
    assert (event.function, event.file, event.line) == ("<module>", "/w/train.py", 20)


def test_tpu_eager_events_take_the_duration_of_their_chromium_event() -> None:
    """Records shaped as torch_tpu._internal.tracing emits them: chromium_event, then the artifact pair."""

    def artifact(name: str, hit: bool) -> dict[str, Any]:
        return {
            "artifact": {
                "name": name,
                "encoding": "string",
                "op_name": "aten::add",
                "cache_hit": hit,
                "compile_failed": False,
                "reason": "item()",
            }
        }

    recs: list[tuple[dict[str, Any], str | None]] = []
    for hit in (False, True):
        recs += [
            ({"chromium_event": {}}, json.dumps({"name": "eager", "ph": "X", "ts": 1.0, "dur": 2500.0})),
            (artifact("torchtpu_eager_aten_graph", hit), "graph():\n  %add = aten.add"),
            (artifact("torchtpu_eager_stablehlo", hit), "module {}"),
        ]
    events = run_builder(recs)
    assert [(e.kind, e.function, e.cache_hit, e.reason, e.duration_s) for e in events] == [
        ("tpu_eager", "aten::add", False, "item()", 0.0025),
        ("tpu_eager", "aten::add", True, "item()", 0.0025),
    ]


def test_recompile_reasons_split_per_cache_entry() -> None:
    text = (
        "0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8\n0/1: n == 2          # return x * n  # a.py:3"
    )
    assert recompile_reasons(text) == ["tensor 'x' size mismatch at index 0. expected 4, actual 8", "n == 2"]
    assert recompile_reasons(None) == []


def test_graph_break_without_user_traceback_still_has_a_location() -> None:
    gb = parse_graph_break("Graph break in user code at /w/m.py:7\nGraph Break Reason: Unsupported thing\n")
    assert (gb.file, gb.line, gb.reason) == ("/w/m.py", 7, "Unsupported thing")


def test_summary_counts_by_frame_and_does_not_mutate_its_input() -> None:
    events = run_builder(compile_records())
    before = copy.deepcopy(events)
    s = summarize(events)
    assert events == before
    assert {k: s[k] for k in ("compiles", "recompiles", "graph_breaks", "cache_hits", "cache_misses")} == {
        "compiles": 2,
        "recompiles": 1,
        "graph_breaks": 1,
        "cache_hits": 1,
        "cache_misses": 1,
    }
    assert s["compile_time_s"] == 4.0
    assert s["recompile_reasons"] == ["tensor 'x' size mismatch at index 0. expected 4, actual 8"]
    (frame,) = s["by_frame"]
    assert (frame["function"], frame["compiles"], frame["recompiles"], frame["compile_time_s"]) == (
        "f",
        2,
        1,
        4.0,
    )
    assert frame["graph_breaks"][0].startswith("/w/demo.py:16: Failed to trace builtin operator")
    text = "\n".join(render_section(s))
    assert "f (/w/demo.py:14): 2 compilations (1 recompiles), 4.00 s" in text
    assert "shapes: x: [4] -> [8]" in text


def test_report_section_from_the_store_with_tpu_counters(db: Path) -> None:
    store = Store(db)
    run = make_run(collectors=["compile"])
    events = run_builder(compile_records(), run.id)
    start = {"num_cache_reqs": 10, "num_cache_hits": 4, "num_compilations": 6}
    end = {"num_cache_reqs": 110, "num_cache_hits": 94, "num_compilations": 16, "num_entries": 16}
    stats = [
        CompileEvent(run.id, -1, "tpu_stats", reason="start", payload=json.dumps(start)),
        CompileEvent(run.id, -2, "tpu_stats", reason="end", payload=json.dumps(end)),
        CompileEvent(run.id, 100, "tpu_eager", function="aten::mul", cache_hit=False, reason="item()"),
        CompileEvent(run.id, 101, "tpu_eager", function="aten::mul", cache_hit=True, reason="item()"),
    ]
    store_with(store, run, {CompileEvent: events + stats})
    section = build_section(store, {"id": run.id, "collectors": ["compile"]})
    assert section is not None
    assert list(section) == [
        "compiles",
        "recompiles",
        "graph_breaks",
        "cache_hits",
        "cache_misses",
        "compile_time_s",
        "recompile_reasons",
        "by_frame",
        "tpu_cache",
    ]
    tpu = section["tpu_cache"]
    assert (tpu["requests"], tpu["hits"], tpu["misses"], tpu["compilations"]) == (100, 90, 10, 10)
    assert tpu["eager"]["top_ops"][0] == {
        "op": "aten::mul",
        "events": 2,
        "misses": 1,
        "hits": 1,
        "failed": 0,
        "duration_s": 0.0,
    }
    assert "TorchTPU executable cache: 100 request(s), 90 hit(s), 10 compilation(s)" in "\n".join(
        render_section(section)
    )
    # A run without the collector and without events has no compile section.
    other = make_run()
    store.put_run(other)
    assert build_section(store, {"id": other.id, "collectors": ["trace"]}) is None


# -- TORCH_TRACE files ---------------------------------------------------------------------------------------
def write_trace(path: Path, records: list[tuple[dict[str, Any], str | None]]) -> Path:
    lines = []
    for meta, payload in records:
        meta = dict(meta)
        if payload is not None:
            meta["has_payload"] = "0123abcd"
        lines.append(f"V1130 05:13:45.711000 13044 torch/_dynamo/utils.py:2350] {json.dumps(meta)}")
        if payload is not None:
            lines += ["\t" + line for line in payload.split("\n")]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reader_matches_the_builder_fed_directly(tmp_path: Path) -> None:
    folder = tmp_path / "trace"
    folder.mkdir()
    write_trace(folder / "dedicated_log_torch_trace_rank_0_abc.log", compile_records())
    write_trace(folder / "dedicated_log_torch_trace_rank_1_def.log", compile_records())
    assert is_torch_trace(folder) and is_torch_trace(next(folder.iterdir()))
    events = read_torch_trace(folder, "r")
    direct = run_builder(compile_records())
    rank0 = [e for e in events if e.rank == 0]
    strip = ("ts_ns", "seq", "rank")
    assert [{k: v for k, v in vars(e).items() if k not in strip} for e in rank0] == [
        {k: v for k, v in vars(e).items() if k not in strip} for e in direct
    ]
    assert sorted({e.rank for e in events}) == [0, 1] and len({e.seq for e in events}) == len(events)


def test_reader_rejects_what_is_not_a_torch_trace(tmp_path: Path) -> None:
    bad = tmp_path / "dedicated_log_torch_trace_x.log"
    bad.write_text("hello world\n")
    assert not is_torch_trace(bad)
    with pytest.raises(ImportFormatError, match="not a TORCH_TRACE record"):
        read_torch_trace(bad, "r")
    broken = tmp_path / "d" / "dedicated_log_torch_trace_y.log"
    broken.parent.mkdir()
    broken.write_text("V1130 05:13:45.711000 1 x.py:1] {not json\n")
    with pytest.raises(ImportFormatError, match="bad record metadata JSON"):
        read_torch_trace(broken.parent, "r")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ImportFormatError, match="no TORCH_TRACE logs"):
        read_torch_trace(tmp_path / "empty", "r")
    with pytest.raises(ImportFormatError, match="no such file"):
        read_torch_trace(tmp_path / "missing", "r")
