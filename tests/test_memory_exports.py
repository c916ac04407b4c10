"""Memory in the exports and the report, on hand-built records: Perfetto counter tracks, the XPlane events that
XProf's own ``memory_profile`` converter reads (run in a child process: its extension next to duckdb can crash),
the report's memory section and an old store migrated to the memory tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb

from tests.factories import make_event, make_run, make_step, store_with
from tpudiag import memory_report
from tpudiag.cli import main
from tpudiag.model import MemoryBlock, MemoryOom, MemoryOomAlloc, MemoryPoint, MemoryStep, Step, TraceEvent
from tpudiag.store import Store

T0 = 1_700_000_000_000_000_000
MIB = 1 << 20
XPROF_MEMORY = """
import json, sys
from xprof.convert import raw_to_tool_data as r
data, _ = r.xspace_to_tool_data([sys.argv[1]], "memory_profile", {})
print(json.dumps(json.loads(data)))
"""


def _run(store: Store) -> str:
    run = make_run()
    rid = run.id
    live = [1, 3, 8, 2, 5, 1]  # MiB after each allocator event; the peak (8 MiB) is in step 1
    store_with(
        store,
        run,
        {
            TraceEvent: [make_event(rid, i, "aten::mm", T0 + i * 1000, 500, module="fc") for i in range(6)],
            Step: [make_step(rid, 0, T0, 2500), make_step(rid, 1, T0 + 2500, 3500)],
            MemoryPoint: [
                MemoryPoint(rid, 0, T0 + i * 1000, b * MIB, "profiler", None, "cpu", 0 if i < 2 else 1)
                for i, b in enumerate(live)
            ],
            MemoryStep: [
                MemoryStep(rid, 0, "sampler", T0 + 2400, "cpu", rss_bytes=300 * MIB, sources='{"rss_bytes": "/proc"}'),
                MemoryStep(rid, 1, "sampler", T0 + 5900, "cpu", rss_bytes=310 * MIB, sources='{"rss_bytes": "/proc"}'),
                MemoryStep(rid, 0, "profiler", T0 + 1000, "cpu", peak_bytes=3 * MIB, sources='{"peak_bytes": "p"}'),
                MemoryStep(rid, 1, "profiler", T0 + 5000, "cpu", peak_bytes=8 * MIB, sources='{"peak_bytes": "p"}'),
            ],
            MemoryBlock: [
                MemoryBlock(rid, 0, "at_peak", 6 * MIB, "profiler", 1, "cpu", "blocks.2", "aten::repeat", "[[4,8]]", 1),
                MemoryBlock(rid, 0, "at_peak", 2 * MIB, "profiler", 2, "cpu", "fc", "aten::mm", None, 1),
                MemoryBlock(rid, 0, "top_alloc", 6 * MIB, "profiler", 1, "cpu", "blocks.2", "aten::repeat", None, 1),
                MemoryBlock(rid, 0, "at_oom", 4 * MIB, "profiler", 1, "cpu", "fc", "aten::mm", None, 1),
            ],
            MemoryOom: [
                MemoryOom(rid, "xla_hbm", "Ran out of memory in memory space hbm. Used 2G of 1G hbm.", "compile", 2,
                          None, None, None, 2 << 30, 1 << 30)
            ],
            MemoryOomAlloc: [
                MemoryOomAlloc(rid, 1, 1 << 30, "f32[1024,262144]", None, None, None, None, "%x", "HLO temp")
            ],
        },
    )  # fmt: skip
    return rid


def test_report_section_merges_step_figures_and_names_the_peak(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    rid = _run(store)
    section = memory_report.build_section(store, {"id": rid})
    assert section is not None
    assert [(s["step"], s["peak_bytes"], s["rss_bytes"]) for s in section["per_step"]] == [
        (0, 3 * MIB, 300 * MIB),
        (1, 8 * MIB, 310 * MIB),
    ]
    assert section["per_step"][1]["sources"] == {"peak_bytes": "p", "rss_bytes": "/proc"}
    assert section["per_step"][0]["allocated_bytes"] is None  # unknown stays None
    assert (section["peak_bytes"], section["peak_step"], section["source"]) == (8 * MIB, 1, "p")
    assert section["by_module_at_peak"] == [
        {"module": "blocks.2", "bytes": 6 * MIB},
        {"module": "fc", "bytes": 2 * MIB},
    ]
    oom = section["oom"]
    assert oom["last_good_peak_bytes"] == 8 * MIB  # step 1's peak, the step before the one that failed
    assert oom["holders"] == [{"module": "fc", "bytes": 4 * MIB}]
    assert oom["allocations"][0]["shape"] == "f32[1024,262144]"
    text = "\n".join(memory_report.render_section(section))
    assert "memory: peak 8.00 MiB at step 1" in text and "XLA #1: 1.00 GiB f32[1024,262144]" in text


def test_perfetto_counter_tracks(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    rid = _run(store)
    assert main(["export", "--db", str(store.path), "--format", "perfetto", "--out", str(tmp_path), rid]) == 0
    trace = json.loads(next(tmp_path.glob("*.trace.json")).read_text())
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    live = [e["args"]["allocated"] for e in counters if e["name"] == "memory cpu"]
    assert live == [b * MIB for b in (1, 3, 8, 2, 5, 1)]
    rss = [e["args"]["rss"] for e in counters if e["name"] == "memory per step cpu"]
    assert rss == [300 * MIB, 310 * MIB]
    pid = counters[0]["pid"]
    names = [e for e in trace["traceEvents"] if e["ph"] == "M" and e["pid"] == pid and e["name"] == "process_name"]
    assert names[0]["args"]["name"] == "memory"
    assert all(e["ts"] >= 0 for e in counters)


def test_xprof_memory_profile_reads_the_exported_allocator_events(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    rid = _run(store)
    out = tmp_path / "tb"
    assert main(["export", "--db", str(store.path), "--format", "tensorboard", "--out", str(out), rid]) == 0
    [pb] = list(out.glob("plugins/profile/*/*.xplane.pb"))
    proc = subprocess.run([sys.executable, "-c", XPROF_MEMORY, str(pb)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    profile = json.loads(proc.stdout)
    assert profile["memoryIds"] == ["cpu"]
    summary = profile["memoryProfilePerAllocator"]["cpu"]["profileSummary"]
    assert int(summary["peakStats"]["peakBytesInUse"]) == 8 * MIB
    assert int(summary["peakBytesUsageLifetime"]) == 8 * MIB


def test_a_version_2_store_gains_the_memory_tables(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    store = Store(path)
    with store.writer():
        pass
    con = duckdb.connect(str(path))
    for table in ("memory_steps", "memory_blocks", "memory_timeline", "memory_oom", "memory_oom_allocs"):
        con.execute(f"DROP TABLE {table}")
    con.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    con.close()
    rid = _run(Store(path))  # the write migrates 2 -> 3 first
    assert memory_report.build_section(Store(path), {"id": rid}) is not None
