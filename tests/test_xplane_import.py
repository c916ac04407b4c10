"""XPlane import (in-process parse, checked against xprof's Events DB): jax/torch_tpu XSpaces, a synthetic TPU plane."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pytest

from tests.conftest import REPO, run_tpudiag
from tpudiag.errors import ImportFormatError
from tpudiag.store import Store, queries
from tpudiag.traces import xplane
from tpudiag.traces import xplane_proto as xp

SAMPLES = REPO / "sample_traces"


def _xspace_events(path: Path) -> int:
    """Independent count: every XEvent of every line of every plane, read with protobuf."""
    space = xp.parse_xspace(path.read_bytes())
    return sum(len(line.events) for plane in space.planes for line in plane.lines)


@pytest.mark.parametrize(
    "name",
    [
        "xla/jax_cpu_train_step.xplane.pb",
        "xla/jax_cpu_matmul_tanh.xplane.pb",
        "torch_tpu/host_only_cpu_activity.xplane.pb",
    ],
)
def test_fixture_xspaces_import_every_event(shared_fixtures: Path, db: Path, name: str) -> None:
    path = shared_fixtures / name
    proc = run_tpudiag("import", str(path), "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip()
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM trace_events WHERE run_id = ?", [run_id]).fetchone() == (
        _xspace_events(path),
    )
    # nesting: self time never exceeds duration; children lie inside their parent
    bad = con.execute(
        """SELECT count(*) FROM trace_events c JOIN trace_events p ON p.run_id = c.run_id AND p.event_id = c.parent_id
           WHERE c.run_id = ? AND (c.start_ns < p.start_ns OR c.start_ns + c.dur_ns > p.start_ns + p.dur_ns)""",
        [run_id],
    ).fetchone()
    assert bad == (0,)
    artifacts = con.execute("SELECT artifacts_dir FROM runs WHERE id = ?", [run_id]).fetchone()
    assert artifacts is not None
    kept = list(Path(artifacts[0]).rglob("*.xplane.pb"))
    assert [p.read_bytes() for p in kept] == [path.read_bytes()]


def test_jax_step_annotations_become_steps(shared_fixtures: Path) -> None:
    tables = xplane.load(shared_fixtures / "xla/jax_cpu_train_step.xplane.pb", "r")
    assert [s.step for s in tables.steps] == list(range(30))  # 30 jitted train steps
    assert all(s.kind == "profiler_step" for s in tables.steps)


def test_tpu_device_plane_ranks_framework_ops_by_device_time(db: Path) -> None:
    path = SAMPLES / "tpu_device.xplane.pb"
    expected = json.loads((SAMPLES / "tpu_device.expected.json").read_text())
    proc = run_tpudiag("import", str(path), "--db", str(db), "--name", "tpu")
    assert proc.returncode == 0, proc.stderr
    run_id = proc.stdout.strip()
    store = Store(db)
    run = queries.resolve_run(store, "tpu")
    assert run["device_kind"] == "tpu"
    ops = queries.slow_ops(store, run_id, by_module=False)
    want = sorted(expected["ops"].items(), key=lambda kv: -kv[1]["ps"])
    assert [o["name"] for o in ops] == [name for name, _ in want]
    for o, (_, e) in zip(ops, want, strict=True):
        assert o["time_source"] == "device"
        assert o["calls"] == e["calls"]
        assert o["self_us"] == pytest.approx(e["ps"] / 1e6, rel=1e-3)  # Events DB rounds to ~256 ns
        assert o["flops"] == pytest.approx(e["flops"])
        assert o["bytes_accessed"] == pytest.approx(e["bytes"])
    con = duckdb.connect(str(db), read_only=True)
    cats = dict(
        con.execute(
            "SELECT hlo_category, count(*) FROM trace_events WHERE run_id = ? AND category = 'xla_op' GROUP BY 1",
            [run_id],
        ).fetchall()
    )
    assert cats == {"convolution fusion": 4, "matmul": 4, "loop fusion": 4, "reduce": 4, "data formatting": 4}
    steps = queries.steps(store, run_id)
    assert [s["step"] for s in steps] == list(range(expected["steps"]))
    assert {s["kind"] for s in steps} == {"device_step"}


_EVENTS_DB = (
    "import sys\n"
    "from xprof.convert.events_db.python import pywrap_events_db_c_api as e\n"
    "e.xspace_to_parquet(input_path=sys.argv[1], output_path=sys.argv[2])\n"
)


def _large_tpu_xspace(path: Path, events: int) -> None:
    sys.path.insert(0, str(SAMPLES))
    try:
        import generate  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    path.write_bytes(generate.tpu_large_xspace(events).SerializeToString())


@pytest.mark.parametrize(
    "name",
    ["xla/jax_cpu_train_step.xplane.pb", "torch_tpu/host_only_cpu_activity.xplane.pb", "tpu_device", "tpu_large"],
)
def test_in_process_reader_matches_xprof_events_db(shared_fixtures: Path, tmp_path: Path, name: str) -> None:
    """Every column tpudiag reads equals xprof's own Events DB conversion (run in a child: it crashes on bad input).

    ``tpu_large``: the benchmark's synthetic TPU XSpace (4 TPU planes, per-event ``group_id`` stats sharing op
    metadata), small enough to stay quick.
    """
    import subprocess

    import pyarrow.parquet as pq

    if name == "tpu_large":
        path = tmp_path / "tpu_large.xplane.pb"
        _large_tpu_xspace(path, 12_000)
    else:
        path = SAMPLES / "tpu_device.xplane.pb" if name == "tpu_device" else shared_fixtures / name
    out = tmp_path / "events.parquet"
    subprocess.run([sys.executable, "-c", _EVENTS_DB, str(path), str(out)], check=True, capture_output=True)
    ref = pq.read_table(out).to_pylist()
    mine = xplane.read_events(path).to_pylist()

    def key(r: dict[str, object]) -> tuple[object, ...]:
        return (r["device"], r["stream_id"] or 0, r["thread_id"] or 0, r["start_ns"], r["kernel_name"], -r["end_ns"])  # type: ignore[operator]

    assert len(mine) == len(ref)
    for a, b in zip(sorted(ref, key=key), sorted(mine, key=key), strict=True):
        for col in b:
            if col in ("start_ns", "end_ns"):  # the Events DB goes through doubles: epoch times round to ~256 ns
                assert abs(a[col] - b[col]) < 512, (col, a, b)
            else:
                assert a[col] == b[col], (col, a, b)


def test_large_tpu_xspace_device_time_per_framework_op(tmp_path: Path) -> None:
    """Column-wise decoding at scale: per framework op, calls and device time equal a plain protobuf walk."""
    path = tmp_path / "tpu_large.xplane.pb"
    _large_tpu_xspace(path, 40_000)
    space = xp.parse_xspace(path.read_bytes())
    want: dict[str, list[int]] = {}
    for plane in space.planes:
        names = {k: m.name for k, m in plane.stat_metadata.items()}
        for line in plane.lines:
            if line.name != "XLA Ops":
                continue
            for ev in line.events:
                meta = plane.event_metadata[ev.metadata_id]
                tf_op = next(s.str_value for s in meta.stats if names[s.metadata_id] == "tf_op")
                entry = want.setdefault(tf_op.rsplit(":", 1)[0], [0, 0])
                entry[0] += 1
                entry[1] += ev.duration_ps // 1000
    events = xplane.load(path, "r").events
    got: dict[str, list[int]] = {}
    for op, dur, dev in zip(
        events.column("framework_op").to_pylist(),
        events.column("dur_ns").to_pylist(),
        events.column("on_device").to_pylist(),
        strict=True,
    ):
        if dev and op:
            entry = got.setdefault(op, [0, 0])
            entry[0] += 1
            entry[1] += dur
    assert got == want
    assert events.num_rows == _xspace_events(path)


def _large_tpu_space(events: int, cores: int) -> Any:
    sys.path.insert(0, str(SAMPLES))
    try:
        import generate
    finally:
        sys.path.pop(0)
    return generate.tpu_large_xspace(events, cores=cores)


def _load_both_ways(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[xplane.XPlaneTables, xplane.XPlaneTables]:
    """(in-process load, two-process load) of ``path``; fails if the two-process read fell back."""
    here = xplane.load(path, "r", rank=2, first_event_id=5)
    finished: list[bool] = []
    real = xplane._read_parallel

    def spied(*args: Any) -> Any:
        out = real(*args)
        finished.append(out[1] is not None)
        return out

    with monkeypatch.context() as m:
        m.setattr(xplane, "PARALLEL_MIN_BYTES", 0)
        m.setattr(xplane, "_read_parallel", spied)
        shared = xplane.load(path, "r", rank=2, first_event_id=5, parallel=True)
    assert len(finished) == 1, "the two-process read fell back to the in-process one"
    return here, shared


def _assert_same(here: xplane.XPlaneTables, shared: xplane.XPlaneTables) -> None:
    assert shared.events.column_names == here.events.column_names
    for name in here.events.column_names:  # dictionaries may differ; values may not
        a, b = here.events.column(name), shared.events.column(name)
        if pa.types.is_dictionary(a.type):
            a, b = a.cast(a.type.value_type), b.cast(b.type.value_type)
        assert a.to_pylist() == b.to_pylist(), name
    assert shared.steps == here.steps
    assert shared.devices == here.devices


@pytest.mark.parametrize("name", ["tpu_large", "tpu_new_steps", "jax_two_hosts", "tpu_device"])
def test_two_process_load_equals_the_in_process_load(
    shared_fixtures: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """Planes read, nested and given args by the forked worker join the parent's in file order: same rows.

    ``jax_two_hosts``: the jax fixture's host plane twice (the second renamed), so that host step annotations, flows
    and step names come from both processes; ``tpu_new_steps``: the worker's planes name steps the parent's do not.
    """
    path = tmp_path / f"{name}.xplane.pb"
    if name == "tpu_large":
        _large_tpu_xspace(path, 20_000)
    elif name == "tpu_new_steps":
        space = _large_tpu_space(8_000, cores=2)
        for meta in space.planes[2].event_metadata.values():
            meta.name = str(int(meta.name) + 1000) if meta.name.isdigit() else meta.name
        path.write_bytes(space.SerializeToString())
    elif name == "jax_two_hosts":
        space = xp.parse_xspace((shared_fixtures / "xla/jax_cpu_train_step.xplane.pb").read_bytes())
        twin = space.planes.add()
        twin.CopyFrom(next(p for p in space.planes if p.name == "/host:CPU"))
        twin.name, twin.id = "/host:CPU1", twin.id + 1000
        path.write_bytes(space.SerializeToString())
    else:
        path = SAMPLES / "tpu_device.xplane.pb"
    here, shared = _load_both_ways(path, monkeypatch)
    assert here.events.num_rows == _xspace_events(path)
    _assert_same(here, shared)


def test_two_process_load_with_one_device_on_both_sides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two planes of one device split between the processes: their threads are nested together, as in-process."""
    space = _large_tpu_space(8_000, cores=2)
    assert [p.name for p in space.planes] == ["/host:CPU", "/device:TPU:0", "/device:TPU:1"]
    space.planes[2].name = "/device:TPU:0"
    path = tmp_path / "same_device.xplane.pb"
    path.write_bytes(space.SerializeToString())
    here, shared = _load_both_ways(path, monkeypatch)
    assert here.events.column("process").unique().to_pylist() and here.devices == ["TPU:0"]
    _assert_same(here, shared)


@pytest.mark.parametrize("bad_plane", [1, -1])
def test_two_process_load_of_a_corrupt_plane_fails_as_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad_plane: int
) -> None:
    """A plane that does not decode, in the parent's part or the worker's: the same one-line error."""
    raw = xp.parse_raw_xspace(_large_tpu_space(4_000, cores=4).SerializeToString())
    raw.planes[bad_plane].lines[0].events.append(b"\x00\x01")  # field number 0: not protobuf
    path = tmp_path / "bad.xplane.pb"
    path.write_bytes(raw.SerializeToString())
    with pytest.raises(ImportFormatError) as in_process:
        xplane.load(path, "r")
    monkeypatch.setattr(xplane, "PARALLEL_MIN_BYTES", 0)
    with pytest.raises(ImportFormatError) as two_process:
        xplane.load(path, "r", parallel=True)
    assert str(two_process.value) == str(in_process.value)
    assert "not a readable XPlane file" in str(in_process.value)
