"""The numerics report section and the repro command on hand-built records in a real DuckDB store."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import run_tpudiag
from tests.factories import make_run, store_with
from tpudiag import numerics_report
from tpudiag.model import OpDiff, OpRecord
from tpudiag.store import Store, queries


def _op(run_id: str, seq: int, op: str, **kw: Any) -> OpRecord:
    fields: dict[str, Any] = {
        "run_id": run_id,
        "seq": seq,
        "op": op,
        "checked": True,
        "phase": "forward",
        "module": "m.a",
        "source_loc": "model.py:10",
        "flops": 10.0,
        "kind": "elementwise",
    }
    fields.update(kw)
    return OpRecord(**fields)


def _diff(run_id: str, seq: int, verdict: str = "pass", **kw: Any) -> OpDiff:
    fields: dict[str, Any] = {
        "run_id": run_id,
        "seq": seq,
        "output_index": 0,
        "verdict": verdict,
        "dtype": "float32",
        "scaled_error": 1.0,
        "threshold": 32.0,
        "numel": 4,
    }
    fields.update(kw)
    return OpDiff(**fields)


def _store(db: Path) -> tuple[Store, dict[str, Any]]:
    store = Store(db)
    run = make_run(collectors=["numerics"])
    rid = run.id
    ops = [
        _op(rid, 1, "aten::mm", kind="matmul"),
        _op(rid, 2, "aten::randn", checked=False, skip_reason="random", flops=None),
        _op(rid, 3, "aten::mm", kind="matmul", module="m.b"),
        _op(rid, 4, "aten::tanh", module="m.act", source_loc="act.py:7"),
        _op(rid, 5, "aten::mul", module="m.act"),
        _op(rid, 6, "aten::exp", checked=False, skip_reason="sampled", calls=40, flops=400.0),
        _op(rid, 9, "aten::sum", phase="backward", kind="reduction"),
    ]
    diffs = [
        _diff(rid, 1),
        _diff(
            rid,
            3,
            "expected_precision",
            scaled_error=900.0,
            emulated_error=800.0,
            precision=json.dumps({"float32_matmul_precision": "medium"}),
        ),
        _diff(rid, 4, "fail", role="originator", scaled_error=25000.0, max_rel=3e-3, repro_path="x"),
        _diff(rid, 5, "pass", role="propagator", propagated_error=5000.0),
        _diff(rid, 9, "pass"),
        _diff(rid, 9, "skip", output_index=1, skip_reason="ties"),
    ]
    store_with(store, run, {OpRecord: ops, OpDiff: diffs})
    return store, {"id": rid, "collectors": ["numerics"], "precision": {"float32_matmul_precision": "medium"}}


def test_section_has_exactly_the_issue_keys_and_counts_calls(db: Path) -> None:
    store, run = _store(db)
    sec = numerics_report.build_section(store, run)
    assert sec is not None
    assert set(sec) == {"coverage", "first_divergence", "divergent_ops", "precision"}
    cov = sec["coverage"]
    assert cov["ops_seen"] == 6 + 40  # the aggregated sampled row counts its 40 calls
    assert cov["ops_checked"] == 5
    assert cov["skipped"] == {"sampled": 40, "random": 1}
    assert cov["flops_checked"] == 50.0 and cov["flops_skipped"]["sampled"] == 400.0
    assert cov["outputs_skipped"] == {"ties": 1}
    assert cov["divergent"] == {"expected_precision": 1, "originator": 1, "propagator": 1}
    assert sec["precision"]["float32_matmul_precision"] == "medium"


def test_first_divergence_is_the_first_real_fault_not_expected_precision(db: Path) -> None:
    store, run = _store(db)
    sec = numerics_report.build_section(store, run)
    assert sec is not None
    first = sec["first_divergence"]
    assert (first["seq"], first["op"], first["module"], first["source"], first["role"]) == (
        4,
        "aten::tanh",
        "m.act",
        "act.py:7",
        "originator",
    )
    assert first["metrics"]["scaled_error"] == 25000.0 and first["repro"] == f"tpudiag repro {run['id']} 4"
    assert [e["seq"] for e in sec["divergent_ops"]] == [3, 4, 5]
    assert sec["divergent_ops"][0]["verdict"] == "expected_precision"
    assert sec["divergent_ops"][0]["precision"] == {"float32_matmul_precision": "medium"}


def test_text_leads_with_the_first_divergence(db: Path) -> None:
    store, run = _store(db)
    sec = numerics_report.build_section(store, run)
    assert sec is not None
    lines = numerics_report.render_section(sec)
    assert lines[1].startswith("  FIRST DIVERGENCE: seq 4 aten::tanh in m.act (forward), act.py:7")
    text = "\n".join(lines)
    assert "expected precision loss (1)" in text and "coverage: 5 of 46 op calls checked" in text


def test_no_numerics_data_gives_null_and_zero_checked_warns(db: Path) -> None:
    store = Store(db)
    plain = make_run(collectors=["trace"])
    store_with(store, plain, {})
    assert numerics_report.build_section(store, {"id": plain.id, "collectors": ["trace"]}) is None
    run = make_run(collectors=["numerics"])
    store_with(store, run, {OpRecord: [_op(run.id, 1, "aten::randn", checked=False, skip_reason="random")]})
    sec = numerics_report.build_section(store, {"id": run.id, "collectors": ["numerics"]})
    assert sec is not None
    assert sec["coverage"]["warning"] == "no op was checked: every op was skipped (see skipped)"
    assert sec["first_divergence"] is None
    assert "WARNING" in "\n".join(numerics_report.render_section(sec))


def test_the_report_command_shows_the_section(db: Path, tmp_path: Path) -> None:
    store, run = _store(db)
    section = numerics_report.build_section(store, queries.resolve_run(store, run["id"]))  # as stored
    assert section is not None and section["first_divergence"]["seq"] == 4
    data = json.loads(run_tpudiag("report", "--db", str(db), run["id"], "--json", cwd=tmp_path).stdout)
    assert data["numerics"] == json.loads(json.dumps(section, default=str))
    text = run_tpudiag("report", "--db", str(db), run["id"], cwd=tmp_path).stdout
    assert "\n".join(numerics_report.render_section(section)) in text


def test_repro_errors_are_one_line(db: Path, tmp_path: Path) -> None:
    _, run = _store(db)
    no_inputs = run_tpudiag("repro", "--db", str(db), run["id"], "5", cwd=tmp_path)
    assert no_inputs.returncode == 2 and no_inputs.stderr.count("\n") == 1
    assert "no saved inputs" in no_inputs.stderr
    unknown = run_tpudiag("repro", "--db", str(db), run["id"], "77", cwd=tmp_path)
    assert unknown.returncode == 5 and "no recorded op with seq 77" in unknown.stderr
    assert "Traceback" not in unknown.stderr + no_inputs.stderr
