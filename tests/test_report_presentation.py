"""How the report reads: human units, compute ops before autograd bookkeeping, short source paths, the
precision knobs of the run's device, and no "all clear" when nothing was checked or the script crashed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.factories import make_event, make_run, make_step, store_with
from tpudiag import numerics_report, report
from tpudiag.display import device_precision, host_op_kind, short_source
from tpudiag.model import OpDiff, OpRecord, Step, TraceEvent
from tpudiag.store import Store

VENV = "/home/u/proj/.venv/lib/python3.11/site-packages"


@pytest.mark.parametrize(
    ("source", "script", "expected"),
    [
        (f"{VENV}/transformers/models/llama/modeling_llama.py:66", "/home/u/proj/train.py",
         "transformers/models/llama/modeling_llama.py:66"),
        ("/usr/lib/python3/dist-packages/torch/nn/functional.py:1", None, "torch/nn/functional.py:1"),
        ("/home/u/proj/models/net.py:12", "/home/u/proj/train.py", "models/net.py:12"),
        ("/usr/lib/python3.11/contextlib.py:81", "/home/u/proj/train.py", "contextlib.py:81"),
        ("/elsewhere/x.py:3", "/home/u/proj/train.py", "/elsewhere/x.py:3"),
        ("model.py:10", None, "model.py:10"),
        (None, None, None),
    ],
)  # fmt: skip
def test_short_source(source: str | None, script: str | None, expected: str | None) -> None:
    assert short_source(source, script) == expected


def test_precision_knobs_of_the_runs_device() -> None:
    knobs = {
        "float32_matmul_precision": "highest",
        "cuda_matmul_allow_bf16_reduced_precision": True,
        "cudnn_allow_tf32": True,
        "tpu_precision": "DEFAULT",
    }
    assert device_precision(knobs, "cpu") == {"float32_matmul_precision": "highest"}
    assert set(device_precision(knobs, "cuda")) == {
        "float32_matmul_precision",
        "cuda_matmul_allow_bf16_reduced_precision",
        "cudnn_allow_tf32",
    }
    assert set(device_precision(knobs, "tpu")) == {"float32_matmul_precision", "tpu_precision"}
    assert device_precision(knobs, None) == knobs


def test_op_kinds() -> None:
    assert host_op_kind("aten::addmm") == "compute"
    assert host_op_kind("autograd::engine::evaluate_function: AddmmBackward0") == "autograd"
    assert host_op_kind("torch::autograd::AccumulateGrad") == "autograd"
    assert host_op_kind("ynn_fusion", "xla_host_op") == "compute"
    assert host_op_kind("Optimizer.step#SGD.step") == "other"


def test_text_report_lists_compute_ops_first_in_human_units(db: Path) -> None:
    store = Store(db)
    run = make_run(duration_s=0.197891)
    rid = run.id
    events = [
        make_event(rid, 0, "autograd::engine::evaluate_function: AddmmBackward0", 0, 90_000_000),
        make_event(rid, 1, "aten::addmm", 90_000_000, 40_000_000),
        make_event(rid, 2, "torch::autograd::AccumulateGrad", 130_000_000, 30_000_000),
        make_event(rid, 3, "aten::relu", 160_000_000, 20_000_000),
    ]
    steps = [make_step(rid, 0, 0, 100_000_000), make_step(rid, 1, 100_000_000, 80_000_000)]
    store_with(store, run, {TraceEvent: events, Step: steps})
    data = report.build(store, report.run_summary(store_run(store, rid)))
    kinds = {o["name"]: o["kind"] for o in data["slow_ops"]}
    assert kinds["aten::addmm"] == "compute" and kinds["torch::autograd::AccumulateGrad"] == "autograd"
    assert data["slow_ops"][0]["name"].startswith("autograd::")  # JSON stays ranked by self time
    text = report.render_text(data)
    order = [text.index(n) for n in ("aten::addmm", "aten::relu", "autograd::engine", "torch::autograd")]
    assert order == sorted(order)  # compute ops first, each group by self time
    assert "197.89 ms on testhost" in text and "0.197891" not in text
    assert "first 100.00 ms; steady median 80.00 ms; outside steps 17.89 ms" in text


def store_run(store: Store, rid: str) -> dict[str, object]:
    from tpudiag.store import queries

    return queries.resolve_run(store, rid)


@pytest.mark.parametrize(
    ("status", "exit_code", "checked", "expected"),
    [
        ("ok", 0, 3, "  no divergent op among 3 checked op calls"),
        ("ok", 0, 0, "  WARNING: nothing was checked: 0 op calls compared"),
        ("error", 1, 0, "  WARNING: nothing was checked: 0 op calls compared; the script stopped (error, exit 1)"),
        ("error", 1, 2, "  WARNING: no divergent op among the 2 op calls checked before the script stopped"),
    ],
)
def test_numerics_verdict_says_what_happened(
    db: Path, status: str, exit_code: int, checked: int, expected: str
) -> None:
    store = Store(db)
    precision = {"float32_matmul_precision": "highest", "cuda_matmul_allow_bf16_reduced_precision": True}
    run = make_run(status=status, exit_code=exit_code, collectors=["numerics"], precision=precision)
    ops = [
        OpRecord(run_id=run.id, seq=i, op="aten::mul", checked=i < checked, phase="forward", kind="elementwise")
        for i in range(3)
    ]
    diffs = [OpDiff(run_id=run.id, seq=i, output_index=0, verdict="pass", dtype="float32") for i in range(checked)]
    store_with(store, run, {OpRecord: ops, OpDiff: diffs})
    section = numerics_report.build_section(store, store_run(store, run.id))
    assert section is not None
    lines = numerics_report.render_section(section)
    assert lines[1].startswith(expected)
    assert section["precision"] == {"float32_matmul_precision": "highest"}  # a CPU run: no CUDA knob


def numerics_page(db: Path, monkeypatch: pytest.MonkeyPatch, run_id: str):  # type: ignore[no-untyped-def]
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("TPUDIAG_DB", str(db))
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app" / "main.py"), default_timeout=60)
    at.run()
    at.selectbox(key="run").set_value(run_id)
    at.switch_page("views/numerics.py").run()
    assert not at.exception, at.exception
    return at


def test_numerics_page_no_all_clear_on_a_crashed_run_with_nothing_checked(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(db)
    run = make_run(status="error", exit_code=1, collectors=["numerics"])
    ops = [OpRecord(run_id=run.id, seq=0, op="aten::mul", checked=False, phase="forward", skip_reason="view")]
    store_with(store, run, {OpRecord: ops})
    at = numerics_page(db, monkeypatch, run.id)
    assert not at.success
    assert any("Nothing was checked" in w.value and "exit 1" in w.value for w in at.warning)


def test_numerics_page_first_divergence_card_is_short_and_device_aware(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(db)
    precision = {"float32_matmul_precision": "highest", "cuda_matmul_allow_bf16_reduced_precision": True}
    run = make_run(collectors=["numerics"], precision=precision, script="/home/u/proj/train.py")
    source = f"{VENV}/transformers/models/llama/modeling_llama.py:66"
    ops = [OpRecord(run_id=run.id, seq=0, op="aten::mul", checked=True, phase="forward", source_loc=source)]
    diffs = [
        OpDiff(run_id=run.id, seq=0, output_index=0, verdict="fail", role="originator", dtype="float32",
               scaled_error=1e4, threshold=32.0)
    ]  # fmt: skip
    store_with(store, run, {OpRecord: ops, OpDiff: diffs})
    at = numerics_page(db, monkeypatch, run.id)
    card = "\n".join(c.value for c in at.code)
    assert "source  transformers/models/llama/modeling_llama.py:66" in card and "site-packages" not in card
    assert "float32_matmul_precision=highest" in card and "cuda" not in card
