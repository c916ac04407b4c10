"""The dashboard's Memory page through Streamlit's AppTest on a real store of hand-built memory records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_dashboard_pages import goto, open_app
from tests.test_memory_exports import MIB, _run
from tpudiag.store import Store


def test_memory_page_shows_steps_window_modules_and_the_oom_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(tmp_path / "s.duckdb")
    rid = _run(store)
    at = goto(open_app(store.path, monkeypatch), "memory", rid)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Peak"] == "8.00 MiB" and metrics["Peak step"] == "1" and metrics["Per-module method"] == "profiler"
    assert "The script ran out of memory." in at.error[0].value
    card = "\n".join(t.value for t in at.text)
    assert (
        "asked for: ?   live: 2.00 GiB" in card
        and "limit: 1.00 GiB" in card
        and "last good step's peak: 8.00 MiB" in card
    )
    figs = {
        json.loads(c.proto.spec)["layout"]["title"]["text"]: json.loads(c.proto.spec) for c in at.get("plotly_chart")
    }
    steps = {tr["name"]: tr["y"] for tr in figs["Memory per step (MiB)"]["data"]}
    assert steps == {"peak": [3.0, 8.0], "process RSS": [300.0, 310.0]}  # no allocator: no allocated line at 0
    [live] = figs["Live bytes in the window (MiB)"]["data"]
    assert live["y"] == [1.0, 3.0, 8.0, 2.0, 5.0, 1.0]
    tree = figs["Live at the peak, by module (MiB; boxes include children)"]["data"][0]
    assert dict(zip(tree["ids"], tree["values"], strict=True))["blocks.2"] == 6.0
    assert any(list(d.value["module"]) == ["blocks.2", "fc"] for d in at.dataframe if "op" in d.value.columns)


def test_memory_page_without_memory_says_how_to_capture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.factories import make_run

    store = Store(tmp_path / "s.duckdb")
    run = make_run()
    store.put_run(run)
    at = goto(open_app(store.path, monkeypatch), "memory", run.id)
    assert "--collect trace,memory" in at.code[0].value
    assert MIB  # the shared records module is importable here too
