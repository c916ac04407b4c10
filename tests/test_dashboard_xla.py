"""The Slow ops page on the real TPU v6e-4 trace: per-chip time and HLO ops, as the report gives them."""

from __future__ import annotations

from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from tests.conftest import SHARED_FIXTURES, run_tpudiag
from tpudiag.hlo_report import build_section
from tpudiag.store import Store, queries

MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"
TPU_TRACE = SHARED_FIXTURES / "xla" / "tpu_v6e4_inference.xplane.pb"
pytestmark = pytest.mark.skipif(not TPU_TRACE.is_file(), reason="../shared/fixtures is absent")


def test_slow_ops_page_breaks_tpu_time_down_per_chip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "store.duckdb"
    assert run_tpudiag("import", "--db", str(db), str(TPU_TRACE), cwd=tmp_path).returncode == 0
    store = Store(db)
    run = queries.resolve_run(store, None)
    expected = build_section(store, run, top=50)
    assert expected is not None
    monkeypatch.setenv("TPUDIAG_DB", str(db))
    at = AppTest.from_file(str(MAIN), default_timeout=120)
    at.run()
    at.switch_page("views/slow_ops.py").run()
    assert not at.exception, at.exception
    tables = {tuple(d.value.columns): d.value for d in at.dataframe}
    chips = next(t for cols, t in tables.items() if "async line s" in cols)
    assert list(chips["chip"]) == ["TPU:0", "TPU:1", "TPU:2", "TPU:3"]
    for row, d in zip(chips.to_dict("records"), expected["devices"], strict=True):
        assert row["busy s"] == pytest.approx(d["busy_us"] / 1e6) and row["type"] == "TPU v6 Lite"
    ops = next(t for cols, t in tables.items() if "HBM BW util %" in cols)
    top = ops.to_dict("records")[0]
    assert (top["hlo op"], top["module"], top["kind"]) == ("copy-done.4", "jit_f", "copy")
    assert top["self s (all chips)"] == pytest.approx(77.773, abs=1e-3)
    assert top["per chip s"] == pytest.approx(77.773 / 4, abs=1e-3)
    assert any("4 chips" in c.value for c in at.caption)
    assert "Op self time (sum of 4 chips)" in {m.label for m in at.metric}
    assert any(c.proto.spec and "HLO op self time by module" in c.proto.spec for c in at.get("plotly_chart"))
