"""The dashboard's queries and page logic on hand-built runs in a real DuckDB store (no Streamlit here)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tests.factories import make_run
from tests.test_dashboard_fixtures import HOSTILE, MODULES, RichStore, build_rich_store, expected_top_ops
from tpudiag.app import charts
from tpudiag.app.common import chart_text, fmt_ns
from tpudiag.app.compilation import frame_rows, headline
from tpudiag.app.numerics import first_divergence_fields, repro_command
from tpudiag.app.runs import run_rows
from tpudiag.app.slow_ops import module_paths, top_table
from tpudiag.store import Store
from tpudiag.store import dashboard_queries as q


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> RichStore:
    return build_rich_store(tmp_path_factory.mktemp("dash") / "store.duckdb")


def test_runs_headlines(rich: RichStore) -> None:
    view = q.load_runs(rich.store)
    by_name = {r["name"]: r for r in view.runs}
    assert view.total == 3
    base, cand = by_name["base"], by_name["cand"]
    top_host = expected_top_ops(rich.base)[0]
    assert (base["slowest_op"], base["slowest_self_ns"]) == (top_host[0], top_host[2])
    top_device = expected_top_ops(rich.cand, device=True)[0]
    assert cand["slowest_op"] == top_device[0] and cand["device"] is True
    assert base["events"] == len(rich.base.events)
    assert (base["first_divergence_seq"], base["first_divergence_op"]) == (17, "aten::tanh")
    assert cand["first_divergence_seq"] is None and cand["ops_checked"] > 0
    assert base["recompiles"] == sum(1 for c in rich.base.compiles if c.kind == "recompile")
    rows = {r["name"]: r for r in run_rows(view.runs)}
    assert rows["base"]["first divergence"] == "aten::tanh @ 17 (encoder.layer0.mlp)"
    assert rows["cand"]["first divergence"] == "none"
    assert rows["cand"]["slowest op"].endswith("device)")


def test_runs_search_is_a_parameter(rich: RichStore) -> None:
    assert [r["name"] for r in q.load_runs(rich.store, search="CAND").runs] == ["cand"]
    # The hostile name is data: searching for its SQL fragment finds exactly that run and breaks nothing.
    found = q.load_runs(rich.store, search="DROP TABLE runs; --").runs
    assert [r["name"] for r in found] == [HOSTILE]
    assert q.load_runs(rich.store, search="' OR 1=1 --").total == 0
    assert q.load_runs(rich.store, statuses=["failed"]).total == 0
    assert q.load_runs(rich.store, statuses=["ok"]).total == 3


def test_slow_ops_ranking_and_totals(rich: RichStore) -> None:
    rid = rich.base.run.id
    view = q.load_slow_ops(rich.store, rid, "op")
    expected = expected_top_ops(rich.base)
    assert [(r["name"], r["calls"], r["self_ns"]) for r in view.top] == expected
    assert view.time_source == "host"
    assert view.totals["self_ns"] == sum(e.self_ns for e in rich.base.events)
    table = top_table(view.top, int(view.totals["self_ns"]), "op")
    assert "module" not in table[0] and abs(sum(r["share %"] for r in table) - 100.0) < 0.05
    assert [r["step"] for r in view.steps] == [s.step for s in rich.base.steps]
    per_step: dict[int, int] = {}
    for r in q.load_step_breakdown(rich.store, rid, steps=len(view.steps)).rows:
        per_step[r["step"]] = per_step.get(r["step"], 0) + r["self_ns"]
    assert per_step == {s.step: sum(e.self_ns for e in rich.base.events if e.step == s.step) for s in rich.base.steps}


def test_slow_ops_filters(rich: RichStore) -> None:
    rid = rich.base.run.id
    events = rich.base.events
    fwd = q.load_slow_ops(rich.store, rid, "op", q.OpFilter(phase="forward"))
    assert fwd.totals["events"] == sum(1 for e in events if e.phase == "forward")
    layer0 = q.load_slow_ops(rich.store, rid, "module", q.OpFilter(module="encoder.layer0"))
    assert {r["module"] for r in layer0.top} == {"encoder.layer0.attn", "encoder.layer0.mlp"}
    step2 = q.load_slow_ops(rich.store, rid, "op_module", q.OpFilter(step=2, name_contains="MM"))
    assert step2.totals["events"] == sum(1 for e in events if e.step == 2 and e.name == "aten::mm")
    assert all(r["name"] == "aten::mm" for r in step2.top)
    nothing = q.load_slow_ops(rich.store, rid, "op", q.OpFilter(name_contains="'; DROP TABLE trace_events"))
    assert nothing.top == [] and nothing.totals["events"] == 0


def test_device_time_source(rich: RichStore) -> None:
    view = q.load_slow_ops(rich.store, rich.cand.run.id, "op")
    assert view.time_source == "device"
    assert [r["name"] for r in view.top] == [n for n, _c, _t in expected_top_ops(rich.cand, device=True)]


def test_module_paths_and_op_detail(rich: RichStore) -> None:
    rid = rich.base.run.id
    paths = module_paths(q.load_slow_ops(rich.store, rid, "op").modules)
    assert paths == sorted({"encoder", "encoder.layer0", "encoder.layer1", "head", *MODULES})
    mm = [e for e in rich.base.events if e.name == "aten::mm"]
    d = q.load_op_detail(rich.store, rid, "aten::mm")
    assert d.summary["calls"] == len(mm) and d.summary["max_self_ns"] == max(e.self_ns for e in mm)
    assert sum(r["calls"] for r in d.histogram) == len(mm)
    assert {r["module"] for r in d.places} == {e.module for e in mm}
    assert [r["step"] for r in d.per_step] == [0, 1, 2, 3]
    assert d.shapes[0]["calls"] == len(mm)


def test_step_timeline(rich: RichStore) -> None:
    rid = rich.base.run.id
    step = rich.base.steps[1]
    tl = q.load_step_timeline(rich.store, rid, 1, limit=5)
    assert tl is not None
    inside = [e for e in rich.base.events if step.start_ns <= e.start_ns < step.start_ns + step.dur_ns]
    assert tl.total == len(inside) and tl.shown == 5
    assert [e["dur_ns"] for e in tl.events] == sorted((e.dur_ns for e in inside), reverse=True)[:5]
    assert all(0 <= e["offset_ns"] < step.dur_ns for e in tl.events)
    assert q.load_step_timeline(rich.store, rid, 99) is None
    fig = charts.step_timeline(tl.events)
    assert sum(len(tr.x) for tr in fig.data) == 5


def test_numerics_view(rich: RichStore) -> None:
    view = q.load_numerics(rich.store, rich.base.run.id)
    ops = rich.base.ops
    assert view.coverage["ops_seen"] == len(ops)
    assert view.coverage["ops_checked"] == sum(1 for o in ops if o.checked)
    assert view.skipped == [{"reason": "random", "ops": sum(1 for o in ops if not o.checked)}]
    first = view.first_divergence
    assert first is not None
    assert (first["seq"], first["op"], first["role"], first["verdict"]) == (
        17,
        "aten::tanh",
        "originator",
        "fail",
    )
    assert {r["seq"]: r["originator"] for r in view.marked} == {17: True, 19: False}
    rollup = {r["module"]: r for r in view.modules}
    assert rollup["encoder.layer0.mlp"]["divergent"] == 1 and rollup["encoder.layer0.mlp"]["originators"] == 1
    assert rollup["encoder.layer0.mlp"]["first_divergent_seq"] == 17
    assert [r["seq"] for r in view.divergent] == [17, 19]
    assert len(view.series) == sum(1 for d in rich.base.diffs)
    fields = {f["field"]: f["value"] for f in first_divergence_fields(first, {"precision": {}})}
    assert fields["op"] == "aten::tanh" and fields["precision"] == "not recorded"
    assert repro_command(rich.store, "run-x", 17).endswith("run-x 17")


def test_numerics_series_keeps_peaks_when_bucketed(rich: RichStore) -> None:
    view = q.load_numerics(rich.store, rich.base.run.id, max_points=5)
    assert view.series_bucketed and len(view.series) <= 6
    assert max(r["error"] for r in view.series) == max(d.scaled_error or 0 for d in rich.base.diffs)
    assert 17 in [r["seq"] for r in view.series]
    fig = charts.error_along_run(view.series, view.marked, 17)
    names = [tr.name for tr in fig.data]
    assert "originator" in names and "divergent" in names
    originators = next(tr for tr in fig.data if tr.name == "originator")
    assert list(originators.x) == [17]


def test_numerics_absent(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    run = make_run()
    store.put_run(run)
    view = q.load_numerics(store, run.id)
    assert view.coverage["ops_seen"] == 0 and view.first_divergence is None and view.series == []


def test_compile_view(rich: RichStore) -> None:
    view = q.load_compile(rich.store, rich.base.run.id)
    events = rich.base.compiles
    h = headline(view.kinds, view.cache)
    assert h["recompiles"] == sum(1 for c in events if c.kind == "recompile")
    assert h["compiles"] == sum(1 for c in events if c.kind in ("compile", "recompile"))
    assert h["compile_s"] == sum(c.duration_s or 0 for c in events if c.kind in ("compile", "recompile"))
    cached = [c for c in events if c.cache_hit is not None]
    assert h["hit_rate"] == sum(1 for c in cached if c.cache_hit) / len(cached)
    frames = frame_rows(view.frames)
    assert frames[0]["function"] == "forward" and frames[0]["recompiles"] == 2
    assert frames[0]["time lost to recompiles s"] == 4.5
    assert "expected 8, actual 16" in frames[0]["reasons"]
    assert frames[0]["where"] in ("model.py:20",)
    only = q.load_compile(rich.store, rich.base.run.id, kinds=["recompile"])
    assert {r["kind"] for r in only.timeline} == {"recompile"}
    assert view.origin_ns == min(c.ts_ns for c in events if c.ts_ns is not None)


def test_compare_view(rich: RichStore) -> None:
    from tpudiag.comparison.dashboard_view import load_view

    a, b = rich.base, rich.cand
    view = load_view(rich.store, a.run.id, b.run.id)
    assert view["runs"]["a"]["time_source"] == "host" and view["runs"]["b"]["time_source"] == "device"
    ea = {n: t for n, _c, t in expected_top_ops(a)}
    eb = {n: t for n, _c, t in expected_top_ops(b, device=True)}
    got = {r["name"]: r["delta_ns"] for r in view["ops"]}
    assert got == {n: eb.get(n, 0) - ea.get(n, 0) for n in set(ea) | set(eb)}
    assert [abs(r["delta_ns"]) for r in view["ops"]] == sorted((abs(v) for v in got.values()), reverse=True)
    tanh = next(r for r in view["result"]["numerics"]["changes"] if r["op"] == "aten::tanh")
    assert (tanh["divergent_a"], tanh["divergent_b"], tanh["change"]) == (1, 0, "improvement")
    assert view["result"]["compile"]["recompiles"]["a"] == 3 and not view["result"]["compile"]["comparable"]


def test_module_tree_and_chart_text() -> None:
    fig = charts.module_tree(
        [
            {"module": "enc.l0.attn", "self_ns": 2e6},
            {"module": "enc", "self_ns": 1e6},
            {"module": None, "self_ns": 5e5},
        ]
    )
    assert fig is not None
    tree = fig.data[0]
    parents = dict(zip(tree.ids, tree.parents, strict=True))
    assert parents == {"enc": "", "enc.l0": "enc", "enc.l0.attn": "enc.l0", "(no module)": ""}
    assert dict(zip(tree.ids, tree.values, strict=True))["enc.l0"] == 0.0
    assert chart_text("<b onclick='x'>&") == "&lt;b onclick=&#x27;x&#x27;&gt;&amp;"
    assert fmt_ns(1_500_000) == "1.50 ms" and fmt_ns(None) == "–"


def test_readers_wait_for_a_writer(tmp_path: Path) -> None:
    """A page read while a capture holds the write lock waits for it instead of failing."""
    store = Store(tmp_path / "busy.duckdb")
    run = make_run(name="busy")
    store.put_run(run)
    held = threading.Event()

    def write() -> None:
        with store.writer():
            held.set()
            time.sleep(0.6)

    t = threading.Thread(target=write)
    t.start()
    held.wait(5)
    t0 = time.monotonic()
    # A second Store object: its own connections, as another process would have.
    view = q.load_runs(Store(store.path))
    t.join()
    assert [r["name"] for r in view.runs] == ["busy"]
    assert 0.2 < time.monotonic() - t0 < 10  # it waited for the writer, then read
