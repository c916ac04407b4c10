"""The real TPU v6e-4 trace: tpudiag's device self time per HLO op agrees with XProf's ``hlo_stats`` tool.

Reference: ``xprof.convert.raw_to_tool_data.xspace_to_tool_data([path], "hlo_stats", {})`` on a copy of the file
(XProf writes caches beside it), run in a child process (xprof's native code and duckdb do not share a process
well).  The TPU op events' own ``offset_ps``/``duration_ps`` are host-clock spans; XProf counts the device spans
(``device_offset_ps``/``device_duration_ps``), which is what tpudiag must count too (a ``copy-done.2`` read from the
host span is 88 s instead of XProf's 77.6 s).  The TensorBoard export of the imported run must give XProf the
same numbers, and be named after the trace's host.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SHARED_FIXTURES, run_tpudiag
from tpudiag.store import Store, hlo_queries, queries

TPU_TRACE = SHARED_FIXTURES / "xla" / "tpu_v6e4_inference.xplane.pb"
HOST = "tpu_v6e4_inference"
pytest.importorskip("xprof")
pytestmark = pytest.mark.skipif(not TPU_TRACE.is_file(), reason="../shared/fixtures is absent")

_HLO_STATS = """
import json, sys
from xprof.convert import raw_to_tool_data
out = raw_to_tool_data.xspace_to_tool_data([sys.argv[1]], "hlo_stats", {})
data = out[0] if isinstance(out, tuple) else out
table = json.loads(data)
cols = [c["id"] for c in table["cols"]]
rows = [{c: (x.get("v") if isinstance(x, dict) else x) for c, x in zip(cols, r["c"])} for r in table["rows"]]
print(json.dumps(rows))
"""


def xprof_hlo_stats(path: Path, work: Path) -> dict[tuple[str, str], dict[str, Any]]:
    """(program id, HLO op name) -> XProf's hlo_stats row, for a copy of ``path``."""
    work.mkdir(parents=True, exist_ok=True)
    copy = work / path.name
    shutil.copyfile(path, copy)
    proc = subprocess.run(
        [sys.executable, "-c", _HLO_STATS, str(copy)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return {(str(r["program_id"]), str(r["hlo_op_name"])): r for r in rows}


def assert_agrees(ours: dict[tuple[str, str], tuple[int, float]], reference: dict[tuple[str, str], Any]) -> None:
    """Same ops, same occurrences, self time within 1% (or 1 ns per occurrence: the store keeps whole ns)."""
    assert set(ours) == set(reference)
    for key, ref in reference.items():
        count, self_us = ours[key]
        assert count == ref["occurrences"], key
        tolerance = max(0.01 * ref["total_self_time"], 1e-3 * ref["occurrences"])
        assert abs(self_us - ref["total_self_time"]) <= tolerance, (key, self_us, ref["total_self_time"])


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("tpu")
    db = work / "store.duckdb"
    proc = run_tpudiag("import", "--db", str(db), str(TPU_TRACE), cwd=work)
    assert proc.returncode == 0, proc.stderr
    store = Store(db)
    run = queries.resolve_run(store, None)
    return {"work": work, "db": db, "store": store, "run": run, "reference": xprof_hlo_stats(TPU_TRACE, work / "ref")}


def test_device_self_time_per_hlo_op_matches_xprof(imported: dict[str, Any]) -> None:
    ops = hlo_queries.hlo_ops(imported["store"], imported["run"]["id"], limit=None)
    ours = {(o["program_id"], o["name"]): (o["occurrences"], o["self_us"]) for o in ops}
    reference = imported["reference"]
    # The ops the issue names, which the host-clock spans got wrong by up to 13%.
    for name, xprof_s in (("copy-done.2", 77.64), ("copy-done.4", 77.77), ("copy-done.5", 72.95)):
        key = next(k for k in reference if k[1] == name)
        assert abs(ours[key][1] / 1e6 - xprof_s) < 0.01
    assert_agrees(ours, reference)
    for o in ops:  # the framework op (JAX's "jit(f)/jit(main)/add:", no type) is XProf's, without the empty type
        assert o["framework_op"] == (reference[(o["program_id"], o["name"])]["tf_op_name"].removesuffix(":") or None)


def test_report_breaks_time_down_per_chip_kind_and_peak(imported: dict[str, Any]) -> None:
    proc = run_tpudiag("report", "--db", str(imported["db"]), "--json", cwd=imported["work"])
    assert proc.returncode == 0, proc.stderr
    section = json.loads(proc.stdout)["hlo_ops"]
    devices = {d["device"]: d for d in section["devices"]}
    assert sorted(devices) == ["TPU:0", "TPU:1", "TPU:2", "TPU:3"]
    for d in devices.values():
        assert d["device_type"] == "TPU v6 Lite" and d["peak_tflops"] == 918.0
        assert d["busy_us"] == pytest.approx(d["compute_us"] + d["copy_us"] + d["collective_us"], rel=1e-6)
        assert d["copy_us"] > 30 * d["compute_us"]  # a host-offload copy benchmark: copies dominate
        assert d["busy_us"] <= d["span_us"]  # one chip is never busy longer than it ran
    assert devices["TPU:0"]["async_us"] > 0  # the Async XLA Ops line is kept apart from busy time
    reference = imported["reference"]
    for op in section["ops"]:
        ref = reference[(op["program_id"], op["name"])]
        assert op["kind"] == hlo_queries.op_kind(ref["category"], op["name"])
        assert sum(op["per_device"].values()) == pytest.approx(op["self_us"], rel=1e-6)
        if op["hbm_bw_util"] is not None and ref["hbm_bw"] and op["self_us"] > op["occurrences"]:  # >= 1 us each
            # XProf's HBM BW is GiB/s; ours a share of the plane's peak in GB/s.
            assert op["hbm_bw_util"] * 1637.993152512e9 == pytest.approx(ref["hbm_bw"] * 2**30, rel=0.01)
    fusion = next(o for o in section["ops"] if o["name"] == "broadcast_add_fusion.1")
    assert fusion["kind"] == "compute" and fusion["gflops_per_s"] == pytest.approx(164.58, rel=0.01)
    kinds = {o["name"]: o["kind"] for o in json.loads(proc.stdout)["slow_ops"]}
    assert kinds["jit(_psum)/jit(main)/reduce_sum"] == "collective"  # its device op is an all-reduce
    assert kinds["copy-done.4"] == "copy" and kinds["jit(f)/jit(main)/add"] == "compute"
    text = run_tpudiag("report", "--db", str(imported["db"]), cwd=imported["work"]).stdout
    assert "TPU:3 (TPU v6 Lite)" in text and "HBM BW util" in text and "77.77 s" in text


def test_tensorboard_export_carries_xprof_attribution_and_trace_host(imported: dict[str, Any]) -> None:
    out = imported["work"] / "tb"
    proc = run_tpudiag(
        "export", "--db", str(imported["db"]), "--format", "tensorboard", "--out", str(out), cwd=imported["work"]
    )
    assert proc.returncode == 0, proc.stderr
    exported = [p for p in out.rglob("*.xplane.pb") if not p.parent.name.endswith("_original")]
    assert [p.name for p in exported] == [f"{HOST}.xplane.pb"]
    got = xprof_hlo_stats(exported[0], imported["work"] / "ref-export")
    ours = {k: (int(r["occurrences"]), float(r["total_self_time"])) for k, r in got.items()}
    assert_agrees(ours, imported["reference"])
