"""The trace collector on real torch.profiler runs: ops, module paths, self times, steps, the user's own profiler."""

from __future__ import annotations

import json
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import EXAMPLES, run_tpudiag
from tpudiag import report
from tpudiag.capture_options import CaptureOptions
from tpudiag.runner import Target
from tpudiag.script_capture import capture_script as capture
from tpudiag.store import Store, queries


@pytest.fixture(scope="module")
def example_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """The bundled example captured once through the CLI, as a user would."""
    work = tmp_path_factory.mktemp("example")
    db = work / "store.duckdb"
    out = run_tpudiag(
        "capture",
        "--db",
        str(db),
        "--collect",
        "trace",
        str(EXAMPLES / "train_mlp.py"),
        "--epochs",
        "2",
        "--batches",
        "4",
        cwd=work,
    )
    assert out.returncode == 0, out.stderr
    rep = run_tpudiag("report", "--db", str(db), "--json", "--top", "200", cwd=work)
    assert rep.returncode == 0, rep.stderr
    return db, json.loads(rep.stdout)


def test_report_names_real_aten_ops_with_module_paths(example_run: tuple[Path, dict]) -> None:
    _, data = example_run
    ops = data["slow_ops"]
    by = {(o["name"], o["module"]): o for o in ops}
    # Forward ops carry the path of the module that ran them.
    assert ("aten::addmm", "embed") in by
    assert ("aten::gelu", "blocks.1.act") in by
    assert ("aten::native_layer_norm", "blocks.2.norm") in by
    assert ("aten::clamp_min", "MLP") in by  # torch.relu called in the root module's own forward
    # Backward ops are attributed to the module of the forward op that created them.
    assert ("aten::gelu_backward", "blocks.0.act") in by
    assert ("aten::native_layer_norm_backward", "blocks.1.norm") in by
    # 2 epochs x 4 batches = 8 forward calls of each layer.
    assert by[("aten::gelu", "blocks.1.act")]["calls"] == 8
    selfs = [o["self_us"] for o in ops]
    assert selfs == sorted(selfs, reverse=True)
    assert all(o["total_us"] >= o["self_us"] >= 0 for o in ops)
    # Only the trace collector was asked for: the other sections are absent, not empty.
    assert data["run"]["collectors"] == ["trace"]
    assert data["numerics"] is None and data["compile"] is None


def test_steps_follow_the_optimizer_and_record_input_shapes(example_run: tuple[Path, dict]) -> None:
    _, data = example_run
    steps = data["steps"]
    assert steps["count"] == 8 and steps["kind"] == "optimizer"
    assert steps["first_s"] > 0 and steps["steady_median_s"] > 0 and steps["outside_steps_s"] >= 0
    assert [s["input_shapes"] for s in steps["per_step"]] == [[[32, 32]]] * 8
    run = data["run"]
    assert run["device"] == "cpu" and run["torch_version"].startswith("2.")
    assert "float32_matmul_precision" in run["precision"]


def test_raw_chrome_trace_is_kept_beside_the_run(example_run: tuple[Path, dict]) -> None:
    db, data = example_run
    trace_dir = Path(data["run"]["artifacts_dir"]) / "trace"
    files = sorted(trace_dir.glob("kineto-*.json"))
    assert files
    doc = json.loads(files[0].read_text())
    n_complete = sum(1 for e in doc["traceEvents"] if e.get("ph") == "X")
    counts = queries.trace_counts(Store(db), data["run"]["id"])
    assert sum(counts.values()) == sum(
        sum(1 for e in json.loads(f.read_text())["traceEvents"] if e.get("ph") == "X") for f in files
    )
    assert n_complete > 100


def test_self_times_agree_with_torch_key_averages(tmp_path: Path) -> None:
    """Same run, two views: tpudiag's event-tree self time vs torch.profiler's own key_averages()."""
    db = tmp_path / "s.duckdb"
    result = capture(
        Target("script", str(EXAMPLES / "train_mlp.py"), ("--epochs", "1", "--batches", "6")),
        CaptureOptions(db=db, collect=["trace"], collector_options={"trace_chunk_s": 1e9}),
    )
    assert result.exit_code == 0
    (trace,) = [c for c in result.collectors if c.name == "trace"]
    torch_self = {e.key: e.self_cpu_time_total for e in trace.profiler.key_averages()}  # type: ignore[attr-defined]
    ours: dict[str, float] = defaultdict(float)
    for op in queries.slow_ops(Store(db), result.run_id, limit=10_000):
        ours[op["name"]] += op["self_us"]
    total = sum(v for k, v in torch_self.items() if k.startswith("aten::"))
    big = {k: v for k, v in torch_self.items() if k.startswith("aten::") and v > 0.01 * total}
    assert len(big) >= 5
    for name, expected in big.items():
        assert ours[name] == pytest.approx(expected, rel=0.05), name


def test_a_script_with_its_own_profiler_keeps_working(tmp_path: Path) -> None:
    script = tmp_path / "own_prof.py"
    script.write_text(
        textwrap.dedent(
            """
        import json, sys, torch
        from torch.profiler import profile, ProfilerActivity
        m = torch.nn.Linear(16, 16)
        m(torch.randn(2, 16))
        with profile(activities=[ProfilerActivity.CPU]) as p:
            m(torch.randn(3, 16)).relu()
        names = {e.key for e in p.key_averages()}
        m(torch.randn(5, 16)).tanh()
        print(json.dumps(sorted(n for n in names if n.startswith("aten::"))))
        """
        )
    )
    db = tmp_path / "s.duckdb"
    out = run_tpudiag("capture", "--db", str(db), "--collect", "trace", str(script), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "aten::relu" in json.loads(out.stdout.strip().splitlines()[-1])  # the user's profiler saw its ops
    assert "own torch.profiler session" in out.stderr
    run = queries.resolve_run(Store(db), None)
    assert any("own torch.profiler session" in n for n in run["notes"])
    names = {o["name"] for o in queries.slow_ops(Store(db), run["id"], limit=500)}
    # tpudiag traced before and after the user's session, and paused during it.
    assert "aten::tanh" in names and "aten::addmm" in names
    assert "aten::relu" not in names


def test_text_report_lists_slow_ops_and_steps(example_run: tuple[Path, dict]) -> None:
    _, data = example_run
    text = report.render_text(data)
    assert text.startswith(f"run {data['run']['id']}")
    assert "slowest ops by self time (host time)" in text
    assert f"steps: {data['steps']['count']} (optimizer)" in text
    top = data["slow_ops"][0]
    assert top["name"] in text


def test_numerics_checking_beside_the_trace_is_not_ranked_as_the_scripts_ops(tmp_path: Path) -> None:
    """With both collectors on, the oracle's float64 ops and the dispatch mode's wrapper stay out of slow ops."""
    db = tmp_path / "both.duckdb"
    out = run_tpudiag(
        "capture",
        "--db",
        str(db),
        "--collect",
        "trace,numerics",
        str(EXAMPLES / "train_mlp.py"),
        "--epochs",
        "1",
        "--batches",
        "2",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    store = Store(db)
    run = queries.resolve_run(store, None)
    counts = queries.trace_counts(store, run["id"])
    assert counts.get("tpudiag_overhead", 0) > 0  # the checker really ran inside the trace
    ops = queries.slow_ops(store, run["id"], limit=1000)
    names = {o["name"] for o in ops}
    assert "PythonDispatchMode" not in names
    # Every ranked aten op ran in float32 (the script's dtype): no float64 oracle op leaked into the ranking.
    with store.reader() as r:
        leaked = r.execute(
            "SELECT count(*) FROM trace_events WHERE run_id = ? AND category = 'cpu_op' AND dtypes LIKE '%double%'",
            [run["id"]],
        ).fetchall()[0][0]
    assert leaked == 0
    # The checker's own ops are not recorded at all: its ranges hold its time and nothing beneath them (a window
    # that checks every op held ten times the script's events, and the host memory they took).
    with store.reader() as r:
        under = r.execute(
            "SELECT count(*) FROM trace_events e JOIN trace_events p ON p.run_id = e.run_id AND p.event_id = "
            "e.parent_id WHERE e.run_id = ? AND p.name LIKE 'tpudiag::%'",
            [run["id"]],
        ).fetchall()[0][0]
    assert under == 0
    assert {"aten::gelu", "aten::addmm"} <= names
    # An op dispatched through the checker's mode is recorded twice by Kineto (outer call, re-dispatch): it counts
    # once, with the time of the call that did the work. 1 epoch x 2 batches = 2 calls of each layer.
    gelu = [o for o in ops if o["name"] == "aten::gelu" and o["module"] == "blocks.1.act"]
    assert [o["calls"] for o in gelu] == [2]
