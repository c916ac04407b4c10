"""Each dashboard page driven through Streamlit's AppTest on a real store: pick a run, change a filter, and
check the numbers shown against the records written."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from tests.factories import make_run
from tests.test_dashboard_fixtures import HOSTILE, OP_TIMES, RichStore, build_rich_store, expected_top_ops
from tpudiag.app.common import fmt_num
from tpudiag.store import Store

MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"


@pytest.fixture(scope="module")
def rich(tmp_path_factory: pytest.TempPathFactory) -> RichStore:
    return build_rich_store(tmp_path_factory.mktemp("pages") / "store.duckdb")


def open_app(db: Path, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv("TPUDIAG_DB", str(db))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def goto(at: AppTest, page: str, run_id: str | None = None) -> AppTest:
    if run_id is not None:
        at.selectbox(key="run").set_value(run_id)
    at.switch_page(f"views/{page}.py").run()
    assert not at.exception, at.exception
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


# Plain dataframes carry no key in AppTest: find each table by a column only it has.
TABLE_COLUMN = {
    "runs_table": "first divergence",
    "so_table": "share %",
    "nm_first": "field",
    "nm_op_metrics": "output_index",
    "cp_frames": "time lost to recompiles s",
    "cmp_summary": "metric",
    "cmp_ops": "ratio B/A",
    "cmp_numerics": "divergent_a",
}


def frame(at: AppTest, key: str) -> list[dict[str, Any]]:
    for d in at.dataframe:
        if TABLE_COLUMN[key] in d.value.columns:
            return list(d.value.to_dict("records"))
    raise AssertionError(f"no table {key} on the page")


def charts(at: AppTest) -> list[dict[str, Any]]:
    return [json.loads(c.proto.spec) for c in at.get("plotly_chart")]


def test_empty_store_teaches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "nothing.duckdb"
    at = open_app(db, monkeypatch)
    assert "no runs yet" in at.info[0].value
    assert at.code[0].value.startswith(f"tpudiag capture --db {db} ")
    for page in ("slow_ops", "numerics", "compilation", "compare"):
        goto(at, page)
        assert at.code and "tpudiag capture" in at.code[0].value


def test_runs_page(rich: RichStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = open_app(rich.store.path, monkeypatch)
    rows = frame(at, "runs_table")
    assert [r["name"] for r in rows] == [HOSTILE, "cand", "base"]
    base = next(r for r in rows if r["name"] == "base")
    top = expected_top_ops(rich.base)[0]
    assert base["slowest op"].startswith(top[0] + " (")
    assert base["first divergence"].startswith("aten::tanh @ 17")
    assert base["recompiles"] == 3
    at.text_input(key="runs_search").input("cand").run()
    assert [r["name"] for r in frame(at, "runs_table")] == ["cand"]
    assert "1 run(s) match" in [t.value for t in at.text]


def test_slow_ops_page(rich: RichStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = goto(open_app(rich.store.path, monkeypatch), "slow_ops", rich.base.run.id)
    events = rich.base.events
    m = metrics(at)
    assert m["Op events"] == fmt_num(len(events)) and m["Time source"] == "host time"
    assert m["Steps"] == str(len(rich.base.steps))
    expected = expected_top_ops(rich.base)
    assert [r["op"] for r in frame(at, "so_table")] == [n for n, _c, _t in expected]
    assert [r["calls"] for r in frame(at, "so_table")] == [c for _n, c, _t in expected]
    bar = charts(at)[0]["data"][0]
    assert bar["y"][-1] == expected[0][0] and bar["x"][-1] == pytest.approx(expected[0][2] / 1e6)

    steps_chart = next(c for c in charts(at) if c["layout"]["title"]["text"].startswith("Time per step"))
    bars = [tr for tr in steps_chart["data"] if tr["type"] == "bar"]
    assert {tr["name"] for tr in bars} == set(OP_TIMES)
    step0 = sum(tr["y"][0] for tr in bars)
    assert step0 == pytest.approx(sum(e.self_ns for e in events if e.step == 0) / 1e6)

    at.selectbox(key="so_phase").set_value("backward").run()
    backward = [e for e in events if e.phase == "backward"]
    assert metrics(at)["Op events"] == fmt_num(len(backward))
    at.selectbox(key="so_group").set_value("module").run()
    modules = {r["module"] for r in frame(at, "so_table")}
    assert modules == {e.module for e in backward}
    at.selectbox(key="so_timeline_step").set_value(2).run()
    assert any(t.value.startswith("step 2: ") for t in at.text)
    # Op detail follows the op picked (the grouping is by module now, so the list comes from ops).
    at.selectbox(key="so_group").set_value("op").run()
    at.selectbox(key="so_op").set_value("aten::gelu").run()
    gelu = [e for e in backward if e.name == "aten::gelu"]
    assert metrics(at)["Calls"] == fmt_num(len(gelu))


def test_slow_ops_device_run(rich: RichStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = goto(open_app(rich.store.path, monkeypatch), "slow_ops", rich.cand.run.id)
    assert metrics(at)["Time source"] == "device time"
    assert frame(at, "so_table")[0]["op"] == expected_top_ops(rich.cand, device=True)[0][0]


def test_numerics_page(rich: RichStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = goto(open_app(rich.store.path, monkeypatch), "numerics", rich.base.run.id)
    m = metrics(at)
    assert m["Ops seen"] == fmt_num(len(rich.base.ops))
    assert m["Ops checked"] == fmt_num(sum(1 for o in rich.base.ops if o.checked))
    assert m["Divergent ops"] == "2" and m["Originators"] == "1"
    assert (m["Role"], m["Verdict"], m["Normalised error"]) == ("originator", "fail", "25,000")
    card = at.code[0].value.splitlines()
    assert card[0].split() == ["op", "aten::tanh", "(forward,", "seq", "17)"]
    assert card[1].split() == ["module", "encoder.layer0.mlp"] and card[2].split() == [
        "source",
        "model.py:117",
    ]
    spec = charts(at)[0]
    originators = next(t for t in spec["data"] if t.get("name") == "originator")
    assert originators["x"] == [17]
    assert spec["layout"]["yaxis"]["type"] == "log"
    assert at.code[-1].value.endswith(f"{rich.base.run.id} 17")
    at.selectbox(key="nm_op").set_value(19).run()
    assert frame(at, "nm_op_metrics")[0]["role"] == "propagator"
    assert at.code[-1].value.endswith(f"{rich.base.run.id} 19")


def test_numerics_page_clean_and_absent(rich: RichStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = goto(open_app(rich.store.path, monkeypatch), "numerics", rich.cand.run.id)
    assert at.success and "No divergent op" in at.success[0].value
    store = Store(rich.store.path)
    bare = make_run(name="bare", started_at=1_600_000_000.0, script="train.py", argv=["--lr", "0.1"])
    store.put_run(bare)
    at.run()  # the new run shows up without a restart
    goto(at, "numerics", bare.id)
    assert "No numerics" in at.info[0].value
    assert at.code[0].value.endswith("--collect trace,numerics train.py --lr 0.1")


def test_compile_page(rich: RichStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = goto(open_app(rich.store.path, monkeypatch), "compilation", rich.base.run.id)
    events = rich.base.compiles
    m = metrics(at)
    assert m["Recompiles"] == str(sum(1 for c in events if c.kind == "recompile"))
    cached = [c for c in events if c.cache_hit is not None]
    assert m["Cache hit rate"] == f"{100 * sum(1 for c in cached if c.cache_hit) / len(cached):.1f} %"
    frames = frame(at, "cp_frames")
    assert frames[0]["function"] == "forward" and frames[0]["recompiles"] == 2
    timeline = charts(at)[0]
    assert sum(len(t["x"]) for t in timeline["data"]) == len(events)
    at.multiselect(key="cp_kinds").set_value(["recompile"]).run()
    timeline = charts(at)[0]
    assert [t["name"] for t in timeline["data"]] == ["recompile"] and len(timeline["data"][0]["x"]) == 3


def test_compare_page(rich: RichStore, monkeypatch: pytest.MonkeyPatch) -> None:
    at = goto(open_app(rich.store.path, monkeypatch), "compare", rich.cand.run.id)
    at.selectbox(key="cmp_a").set_value(rich.base.run.id).run()
    summary = {r["metric"]: (r["A"], r["B"]) for r in frame(at, "cmp_summary")}
    assert summary["time source"] == ("host", "device")
    assert summary["op events"] == (
        fmt_num(len(rich.base.events)),
        fmt_num(sum(e.on_device for e in rich.cand.events)),
    )
    ops = frame(at, "cmp_ops")
    mm = next(r for r in ops if r["op"] == "aten::mm")
    assert mm["self ms A"] == pytest.approx(sum(e.self_ns for e in rich.base.events if e.name == "aten::mm") / 1e6)
    assert mm["self ms B"] == 0
    assert any(r["op"] == "aten::tanh" and r["divergent_a"] == 1 for r in frame(at, "cmp_numerics"))


def test_hostile_strings_stay_text(rich: RichStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Names from the store never reach Markdown: only text, code, dataframes and escaped chart labels."""
    at = open_app(rich.store.path, monkeypatch)
    for page in ("slow_ops", "numerics", "runs"):
        goto(at, page, rich.hostile.run.id)
        markdownish = [e.value for e in (*at.markdown, *at.caption, *at.header, *at.info, *at.warning, *at.error)]
        assert not any("<script>" in v or "<img" in v or "DROP TABLE" in v for v in markdownish)
        for spec in charts(at):
            blob = json.dumps(spec)
            assert "<img" not in blob and "<b>bold" not in blob and "<script>" not in blob
    goto(at, "slow_ops", rich.hostile.run.id)
    assert HOSTILE in [t.value.split(" · ")[0] for t in at.text]
    assert "&lt;img src=x onerror=alert(1)&gt;" in json.dumps(charts(at)[0])
