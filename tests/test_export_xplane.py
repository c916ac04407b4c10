"""XPlane export on hand-built runs: device planes xprof's own converters read, ranks, original XSpaces."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.factories import make_event, make_run, make_step, store_with
from tpudiag.cli import main
from tpudiag.model import Step, TraceEvent
from tpudiag.store import Store
from tpudiag.traces import xplane_proto as xp

T0 = 1_700_000_000_000_000_000
# xprof's converters run in a child process: loading its extension next to duckdb can crash (DESIGN §4.1).
XPROF_ROWS = """
import json, sys
from xprof.convert import raw_to_tool_data as r
out = {}
for tool in ("framework_op_stats", "hlo_stats"):
    data, _ = r.xspace_to_tool_data([sys.argv[1]], tool, {})
    table = json.loads(data)
    table = table[0] if isinstance(table, list) else table
    cols = [c["id"] for c in table["cols"]]
    out[tool] = [dict(zip(cols, [c.get("v") for c in row["c"]])) for row in table["rows"]]
print(json.dumps(out))
"""


def _tpu_run(store: Store, **run_kw: Any) -> str:
    run = make_run(device_kind="tpu", host="tpu-host", **run_kw)
    events: list[TraceEvent] = []
    k = 0
    for step in range(3):
        base = T0 + step * 1_000_000
        events.append(make_event(run.id, k, "aten::addmm", base, 200_000, module="fc", process="python", thread="main"))
        events.append(
            make_event(
                run.id,
                k + 1,
                "jit_step",
                base + 250_000,
                600_000,
                on_device=True,
                category="xla_module",
                process="/device:TPU:0",
                thread="XLA Modules",
            )
        )
        k += 2
        for j, (name, cat) in enumerate([("fusion.1", "convolution fusion"), ("copy.2", "data formatting")]):
            events.append(
                make_event(
                    run.id,
                    k,
                    name,
                    base + 260_000 + j * 150_000,
                    100_000 + j * 10_000,
                    on_device=True,
                    category="xla_op",
                    process="/device:TPU:0",
                    thread="XLA Ops",
                    hlo_category=cat,
                    framework_op="aten::addmm",
                    args=json.dumps({"program_id": 42}),
                )
            )
            k += 1
    steps = [make_step(run.id, s, T0 + s * 1_000_000, 900_000) for s in range(3)]
    store_with(store, run, {TraceEvent: events, Step: steps})
    return run.id  # fmt: skip


def _export(db: Path, run_id: str, out: Path, *extra: str) -> list[Path]:
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["export", run_id, "--db", str(db), "--format", "tensorboard", "--out", str(out), *extra]) == 0
    return [Path(p) for p in buf.getvalue().split()]


def _stats(plane: Any, owner: Any) -> dict[str, Any]:
    return {plane.stat_metadata[s.metadata_id].name: xp.stat_value(s, plane) for s in owner.stats}


def test_device_plane_layout(db: Path, tmp_path: Path) -> None:
    store = Store(db)
    run_id = _tpu_run(store)
    [path] = _export(db, run_id, tmp_path / "tb")
    assert path == tmp_path / "tb" / "plugins" / "profile" / run_id / "tpu-host.xplane.pb"
    space = xp.parse_xspace(path.read_bytes())
    assert list(space.hostnames) == ["tpu-host"]
    planes = {p.name: p for p in space.planes}
    assert set(planes) == {"/host:CPU", "/device:TPU:0"}
    dev = planes["/device:TPU:0"]
    lines = {line.name: line for line in dev.lines}
    assert set(lines) == {"XLA Modules", "XLA Ops", "Steps"}
    assert len(lines["XLA Ops"].events) == 6 and len(lines["Steps"].events) == 3
    for event in lines["XLA Ops"].events:
        meta = dev.event_metadata[event.metadata_id]
        stats = _stats(dev, meta)
        assert stats["program_id"] == 42 and stats["symbol_id"] > 0
        assert stats["tf_op"] == "aten.addmm:addmm"
    symbols = {_stats(dev, m)["symbol_id"] for m in dev.event_metadata.values() if m.name in ("fusion.1", "copy.2")}
    assert len(symbols) == 2
    # Offsets are relative to the line's epoch timestamp and in picoseconds.
    first = lines["XLA Ops"].events[0]
    assert lines["XLA Ops"].timestamp_ns + first.offset_ps // 1000 == T0 + 260_000
    assert first.duration_ps == 100_000_000


@pytest.mark.slow
def test_xprof_converters_read_device_ops(db: Path, tmp_path: Path) -> None:
    store = Store(db)
    run_id = _tpu_run(store)
    [path] = _export(db, run_id, tmp_path / "tb")
    work = tmp_path / "copy"  # xprof writes caches next to the file
    shutil.copytree(path.parent, work)
    proc = subprocess.run([sys.executable, "-c", XPROF_ROWS, str(work / path.name)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    hlo = {r["hlo_op_name"]: r for r in rows["hlo_stats"]}
    assert hlo["fusion.1"]["occurrences"] == 3 and hlo["fusion.1"]["total_self_time"] == pytest.approx(300.0)
    assert hlo["copy.2"]["total_self_time"] == pytest.approx(330.0)
    assert hlo["fusion.1"]["category"] == "convolution fusion"
    assert hlo["fusion.1"]["program_id"] == "42"
    fw = {(r["host_or_device"], r["operation"]): r for r in rows["framework_op_stats"]}
    assert fw[("Device", "aten.addmm")]["total_self_time"] == pytest.approx(630.0)
    assert fw[("Host", "fc/aten.addmm")]["total_self_time"] == pytest.approx(600.0)


def test_ranks_become_hosts_and_originals_are_copied(db: Path, tmp_path: Path, shared_fixtures: Path) -> None:
    store = Store(db)
    artifacts = tmp_path / "artifacts"
    (artifacts / "trace").mkdir(parents=True)
    original = shared_fixtures / "torch_tpu" / "host_only_cpu_activity.xplane.pb"
    shutil.copy(original, artifacts / "trace" / "tpu-host.xplane.pb")
    run = make_run(host="h", artifacts_dir=str(artifacts))
    events = [make_event(run.id, r * 10 + i, "aten::mul", T0 + i * 1000, 500, rank=r) for r in (0, 1) for i in (0, 1)]
    store_with(store, run, {TraceEvent: events})
    paths = _export(db, run.id, tmp_path / "tb")
    names = sorted(p.relative_to(tmp_path / "tb" / "plugins" / "profile").as_posix() for p in paths)
    assert names == [
        f"{run.id}/h_0.xplane.pb",
        f"{run.id}/h_1.xplane.pb",
        f"{run.id}_original/tpu-host.xplane.pb",
    ]
    assert (tmp_path / "tb/plugins/profile" / f"{run.id}_original/tpu-host.xplane.pb").read_bytes() == (
        original.read_bytes()
    )
    for rank in (0, 1):
        space = xp.parse_xspace((tmp_path / "tb/plugins/profile" / run.id / f"h_{rank}.xplane.pb").read_bytes())
        assert sum(len(line.events) for p in space.planes for line in p.lines) == 2
    skipped = _export(db, run.id, tmp_path / "tb2", "--no-original")
    assert len(skipped) == 2
