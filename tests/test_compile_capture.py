"""The compile collector end to end: real torch.compile on CPU, checked against torch's own counters.

The captured scripts dump ``torch._dynamo.utils.counters`` and ``get_compilation_metrics()`` to a JSON file
from the same process, so every count is compared with what torch itself counted, not with hard-coded numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import REPO, TPU_PYTHON, run_tpudiag
from tpudiag.store import Store, compile_queries
from tpudiag.traces.torch_trace import read_torch_trace

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch._dynamo.utils import counters, get_compilation_metrics

    def f(x):
        y = x.sin() * 2
        print("graph break")  # GRAPH BREAK LINE
        return y.cos() + 1

    cf = torch.compile(f)
    for n in (4, 8):
        cf(torch.randn(n))
    metrics = [
        {"compile_id": str(m.compile_id), "co_name": m.co_name, "recompile_reason": m.recompile_reason,
         "fail_type": m.fail_type}
        for m in get_compilation_metrics()
    ]
    with open(sys.argv[1], "w") as fh:
        json.dump({"counters": {k: dict(v) for k, v in counters.items()}, "metrics": metrics,
                   "torch_trace": os.environ.get("TORCH_TRACE")}, fh)
    """
)
BREAK_LINE = SCRIPT.splitlines().index('    print("graph break")  # GRAPH BREAK LINE') + 1


def _capture(tmp: Path, db: Path, out: Path, env: dict[str, str]) -> dict[str, Any]:
    proc = run_tpudiag("capture", "--db", str(db), "--collect", "compile", "script.py", str(out), cwd=tmp, env=env)
    assert proc.returncode == 0, proc.stderr
    report = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp)
    assert report.returncode == 0, report.stderr
    data: dict[str, Any] = json.loads(report.stdout)
    return data


def const(value: Any) -> Callable[[], Any]:
    return lambda: value


def _torch_counts(dump: dict[str, Any]) -> dict[str, Any]:
    c = dump["counters"]
    return {
        "compiles": len(dump["metrics"]),
        "recompiles": sum(1 for m in dump["metrics"] if m["recompile_reason"]),
        "graph_breaks": sum(c.get("graph_break", {}).values()),
        "cache_hits": c.get("inductor", {}).get("fxgraph_cache_hit", 0)
        + c.get("aot_autograd", {}).get("autograd_cache_hit", 0),
        "cache_misses": c.get("inductor", {}).get("fxgraph_cache_miss", 0)
        + c.get("aot_autograd", {}).get("autograd_cache_miss", 0),
    }


@pytest.mark.slow
def test_cold_then_warm_cache_recompiles_graph_break_and_import(tmp_path: Path) -> None:
    (tmp_path / "script.py").write_text(SCRIPT)
    db = tmp_path / "store.duckdb"
    user_trace = tmp_path / "user_trace"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCH_TRACE": str(user_trace)}

    # Cold cache: every lookup misses; f recompiles for the new size of x, and so does its resume function.
    cold = _capture(tmp_path, db, tmp_path / "cold.json", env)
    dump = json.loads((tmp_path / "cold.json").read_text())
    section = cold["compile"]
    torch_counts = _torch_counts(dump)
    assert {k: section[k] for k in torch_counts} == torch_counts
    assert torch_counts["recompiles"] >= 1 and torch_counts["graph_breaks"] >= 1 and torch_counts["cache_misses"]
    assert section["cache_hits"] == 0
    expected_reasons = [m["recompile_reason"].split(": ", 1)[1] for m in dump["metrics"] if m["recompile_reason"]]
    assert section["recompile_reasons"] == expected_reasons
    assert "tensor 'x' size mismatch at index 0. expected 4, actual 8" in expected_reasons
    f = next(fr for fr in section["by_frame"] if fr["function"] == "f")
    assert (f["compiles"], f["recompiles"], f["shapes"]) == (2, 1, [{"x": [4]}, {"x": [8]}])
    assert f["graph_breaks"] and f["graph_breaks"][0].startswith(f"script.py:{BREAK_LINE}: ")
    assert section["compile_time_s"] > 0

    # The user's own TORCH_TRACE was left alone; importing it gives the same events as the live capture.
    assert dump["torch_trace"] == str(user_trace) and list(user_trace.glob("dedicated_log_torch_trace_*.log"))
    imported = read_torch_trace(user_trace, "imported")
    live = compile_queries.count_by_kind(Store(db), cold["run"]["id"])
    by_kind: dict[str, int] = {}
    for e in imported:
        by_kind[e.kind] = by_kind.get(e.kind, 0) + 1
    assert by_kind == live
    live_events = compile_queries.compile_events(Store(db), cold["run"]["id"])
    assert [(e.kind, e.reason, e.function, e.line, e.shapes) for e in imported] == [
        (e.kind, e.reason, e.function, e.line, e.shapes) for e in live_events
    ]

    # Warm cache: the same compilations, now served from the Inductor and AOTAutograd caches.
    warm_env = {"TORCHINDUCTOR_CACHE_DIR": env["TORCHINDUCTOR_CACHE_DIR"]}
    warm = _capture(tmp_path, db, tmp_path / "warm.json", warm_env)
    warm_dump = json.loads((tmp_path / "warm.json").read_text())
    warm_counts = _torch_counts(warm_dump)
    assert {k: warm["compile"][k] for k in warm_counts} == warm_counts
    assert warm_counts["cache_hits"] > 0 and warm_counts["cache_misses"] == 0

    # Collecting does not change what compiles: a plain run of the script counts the same.
    plain_out = tmp_path / "plain.json"
    import subprocess

    subprocess.run(
        [sys.executable, "script.py", str(plain_out)],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        env={**os.environ, **warm_env},
    )
    plain = json.loads(plain_out.read_text())
    for group in ("frames", "stats", "graph_break", "inductor", "aot_autograd"):
        assert plain["counters"].get(group) == warm_dump["counters"].get(group), group
    assert plain["metrics"] == warm_dump["metrics"]

    text = run_tpudiag("report", "--db", str(db), cold["run"]["id"], cwd=tmp_path).stdout
    assert "frames that recompile most:" in text and "shapes: x: [4] -> [8]" in text


def test_tpu_records_emitted_through_trace_structured(tmp_path: Path) -> None:
    """TorchTPU's records, emitted through torch._logging.trace_structured with exactly the names and metadata
    torch_tpu 0.2.0 uses (torch_tpu/_internal/tracing: chromium_event + torchtpu_eager_aten_graph/_stablehlo
    artifacts with op_name, cache_hit, compile_failed, reason; compile/compiler.py: torchtpu_fx_graph and
    torchtpu_stablehlo_graph), received by the real collector in this process."""
    from torch._logging._internal import trace_structured

    from tpudiag.collectors.compile import CompileCollector
    from tpudiag.plugins import CaptureContext
    from tpudiag.spool import Spool

    ctx = CaptureContext(run_id="tpu", run_dir=tmp_path, spool=Spool(tmp_path / "spool"))
    collector = CompileCollector()
    collector.prepare(ctx)
    collector.start(ctx)
    try:
        batches = [
            ("aten::add", False, False, "item()", 1500.0),
            ("aten::add", True, False, ".cpu()", 20.0),
            ("aten::mm", False, True, "repeated_op_heuristic", 900.0),
        ]
        for op, hit, failed, reason, dur in batches:
            chromium = json.dumps({"name": op, "ph": "X", "ts": 1.0, "dur": dur, "pid": 0, "tid": 0})
            trace_structured("chromium_event", metadata_fn=dict, payload_fn=const(chromium), expect_trace_id=False)
            for name in ("torchtpu_eager_aten_graph", "torchtpu_eager_stablehlo"):
                meta = {
                    "name": name,
                    "encoding": "string",
                    "op_name": op,
                    "cache_hit": hit,
                    "compile_failed": failed,
                    "reason": reason,
                }
                trace_structured(
                    "artifact",
                    metadata_fn=const(meta),
                    payload_fn=lambda: "graph",
                    expect_trace_id=False,
                )
        for name in ("torchtpu_fx_graph", "torchtpu_stablehlo_graph"):
            trace_structured(
                "artifact",
                metadata_fn=const({"name": name, "encoding": "string"}),
                payload_fn=lambda: "module {\n}\n",
                expect_trace_id=False,
            )
    finally:
        collector.stop()
    table = pq.read_table(sorted((tmp_path / "spool" / "compile_events").glob("*.parquet"))).to_pylist()
    eager = [
        (r["function"], r["cache_hit"], r["failed"], r["reason"], r["duration_s"])
        for r in table
        if r["kind"] == "tpu_eager"
    ]
    assert eager == [
        ("aten::add", False, False, "item()", 0.0015),
        ("aten::add", True, False, ".cpu()", 2e-05),
        ("aten::mm", False, True, "repeated_op_heuristic", 0.0009),
    ]
    assert [r["reason"] for r in table if r["kind"] == "tpu_graph"] == [
        "torchtpu_fx_graph",
        "torchtpu_stablehlo_graph",
    ]
    # The graph text itself is kept (its size and head), so a report can say what was compiled.
    graphs = [json.loads(r["payload"]) for r in table if r["kind"] == "tpu_graph"]
    assert graphs == [
        {"artifact": name, "chars": 11, "lines": 3, "head": "module {\n}\n"}
        for name in ("torchtpu_fx_graph", "torchtpu_stablehlo_graph")
    ]


TPU_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch_tpu._internal.tracing as tracing

    out = {"enabled": tracing._tpu_torch_tracing._structured_log_enabled(),
           "env": os.environ.get("TORCH_TRACE")}
    # TorchTPU's own emitters, fed the event dicts its C++ buffer drains into.
    chromium = json.dumps({"name": "aten::add", "ph": "X", "ts": 1, "dur": 1500})
    tracing._emit_chromium({"chromium_payload": chromium})
    tracing._emit_event_artifacts({"name": "aten::add", "cache_hit": False, "compile_failed": False,
                                   "reason": "item()", "aten_graph": "g", "stablehlo": "m"})
    s = torch.tpu._get_cache_stats()
    out["stats"] = {k: getattr(s, k) for k in ("num_cache_reqs", "num_cache_hits", "num_compilations")}
    json.dump(out, open(sys.argv[1], "w"))
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not TPU_PYTHON.exists(), reason="no Python with torch-tpu (set TPUDIAG_TPU_PYTHON)")
def test_real_torch_tpu_package_trace_switch_and_counters(tmp_path: Path) -> None:
    """With the real torch-tpu 0.2.0 installed (no TPU needed): TORCH_TRACE is set before torch loads, so
    TorchTPU records; the script does not inherit it; no trace files stay behind; the counters API is read at
    both ends."""
    (tmp_path / "tpu_script.py").write_text(TPU_SCRIPT)
    db = tmp_path / "store.duckdb"
    env = {"PYTHONPATH": str(REPO), "TPU_SKIP_MDS_QUERY": "1", "PYTHONWARNINGS": "ignore::UserWarning"}
    env_full = {**os.environ, **env}
    env_full.pop("TORCH_TRACE", None)
    import subprocess

    proc = subprocess.run(
        [
            str(TPU_PYTHON),
            "-m",
            "tpudiag",
            "capture",
            "--db",
            str(db),
            "--collect",
            "compile",
            "tpu_script.py",
            str(tmp_path / "out.json"),
        ],
        cwd=tmp_path,
        env=env_full,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["enabled"] is True and out["env"] is None
    store = Store(db)
    run_id = json.loads(run_tpudiag("runs", "--db", str(db), "--json").stdout)[0]["id"]
    assert not (store.run_dir(run_id) / "compile").exists()
    events = compile_queries.compile_events(store, run_id, exclude_kinds=())
    stats = {e.reason: json.loads(e.payload or "{}") for e in events if e.kind == "tpu_stats"}
    assert set(stats) == {"start", "end"}
    assert {k: stats["end"][k] for k in out["stats"]} == out["stats"]
    eager = [(e.function, e.cache_hit, e.reason, e.duration_s) for e in events if e.kind == "tpu_eager"]
    assert eager == [("aten::add", False, "item()", 0.0015)]
    shutil.rmtree(tmp_path / "store.runs", ignore_errors=True)


GAP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch import nn
    from torch._dynamo.utils import counters

    class Breaker(nn.Module):  # a module whose forward breaks the graph: called eagerly in the compiled step's gap
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            torch._dynamo.graph_break()
            return self.lin(x) + 1

    torch.manual_seed(0)
    inner, head = Breaker(), nn.Linear(4, 2)

    @torch.compile(backend="eager")
    def step(x):
        return head(inner(x * 2) * 3)

    outs = []
    for i in range(6):
        outs.append(step(torch.full((3, 4), float(i))).sum().item())
        head(torch.ones(1, 4))  # an eager root call between compiled ones
    with open(sys.argv[1], "w") as fh:
        json.dump({"counters": {k: dict(v) for k, v in counters.items() if k in ("frames", "stats", "graph_break")},
                   "outs": outs}, fh)
    """
)


@pytest.mark.parametrize("collect", ["default", "trace"])
def test_a_graph_break_at_a_module_call_compiles_the_same_under_capture(tmp_path: Path, collect: str) -> None:
    # In a compiled function's graph-break gap Dynamo's frame callback is live: a frame of tpudiag's called from
    # the module call wrapper would be compiled (a different set of frames and graphs), and the first root call of
    # a class, noted under the wrapper's lock, deadlocked on the compile-start callback (session 16).
    import subprocess

    (tmp_path / "script.py").write_text(GAP_SCRIPT)
    plain = subprocess.run(
        [sys.executable, "script.py", "plain.json"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert plain.returncode == 0, plain.stderr
    args = [] if collect == "default" else ["--collect", collect]
    proc = run_tpudiag(
        "capture", "--db", str(tmp_path / "s.duckdb"), *args, "script.py", "captured.json", cwd=tmp_path, timeout=180
    )
    assert proc.returncode == 0, proc.stderr
    expected = json.loads((tmp_path / "plain.json").read_text())
    captured = json.loads((tmp_path / "captured.json").read_text())
    assert expected["counters"]["frames"]["total"] >= 2 and expected["counters"]["graph_break"]
    assert captured == expected
