"""The gate's rules (pyproject parsing, evaluation on comparison results) and the CI output channels."""

from __future__ import annotations

import contextlib
import io
import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.factories import make_snapshot
from tpudiag.cli import main
from tpudiag.comparison import ci_output, rules, snapshot
from tpudiag.comparison.compare import Finding, compare
from tpudiag.comparison.snapshot import Snapshot
from tpudiag.errors import UsageError


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pyproject.toml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    defaults = rules.load_config(None)
    assert [r.metric for r in defaults.rules] == [d["metric"] for d in rules.DEFAULT_RULES]
    assert defaults.source == "defaults"
    path = _write(
        tmp_path,
        """
        [project]
        name = "x"
        [tool.tpudiag.check]
        warmup_steps = 3
        [[tool.tpudiag.check.rules]]
        metric = "steps.steady"
        max_ratio = 1.05
        floor = 0.001
        [[tool.tpudiag.check.rules]]
        metric = "compile.new_graph_breaks"
        enabled = false
        [[tool.tpudiag.check.rules]]
        metric = "compile.cache_misses"
        max_increase = 2
        """.replace("\n        ", "\n"),
    )
    config = rules.load_config(None)  # ./pyproject.toml is read when it has the table
    assert config.source == str(Path("pyproject.toml")) and config.warmup_steps == 3
    by_metric = {r.metric: r for r in config.rules}
    assert "compile.new_graph_breaks" not in by_metric
    assert by_metric["steps.steady"].max_ratio == 1.05 and by_metric["steps.steady"].floor == 0.001
    assert by_metric["compile.cache_misses"].max_increase == 2
    assert rules.load_config(path).rules == config.rules


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('metric = "steps.nope"\nmax_ratio = 1.1', "unknown metric 'steps.nope'"),
        ('metric = "steps.steady"', "steps.steady needs max_ratio"),
        ('metric = "compile.recompiles"', "compile.recompiles is a count: give max or max_increase"),
        ('metric = "steps.steady"\nmax_ratio = 1.1\ndirection = "up"', "direction must be 'lower' or 'higher'"),
        ('metric = "steps.steady"\nmax_ratio = 1.1\nlimit = 3', "unknown rule key(s) limit"),
        ('metric = "steps.steady"\nmax_ratio = "fast"', "rule for steps.steady"),
    ],
)
def test_bad_rules_are_one_clear_error(tmp_path: Path, body: str, message: str) -> None:
    path = _write(tmp_path, f"[tool.tpudiag.check]\n[[tool.tpudiag.check.rules]]\n{body}\n")
    with pytest.raises(UsageError) as err:
        rules.load_config(path)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_no_table_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"has no \[tool\.tpudiag\.check\] table"):
        rules.load_config(_write(tmp_path, "[project]\nname = 'x'\n"))
    with pytest.raises(UsageError, match="cannot read rules"):
        rules.load_config(_write(tmp_path, "[tool.tpudiag.check\n"))


def _steady(median_a: float, median_b: float, verdict: str, p: float = 0.001) -> dict[str, Any]:
    return {
        "median_a": median_a,
        "median_b": median_b,
        "p_value": p,
        "n_a": 20,
        "n_b": 20,
        "verdict": verdict,
    }


def _result(steady: dict[str, Any], shift: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "steps": {"steady": steady},
        "ops": {"entries": [], "uniform_shift": shift},
        "numerics": None,
        "compile": None,
    }


@pytest.mark.parametrize(
    ("steady", "shift", "status"),
    [
        (_steady(1.0, 1.3, "slower"), None, "fail"),  # significant and beyond ×1.10
        (_steady(1.0, 1.05, "slower"), None, "pass"),  # significant but within the allowed ratio
        (_steady(1.0, 1.3, "unstable", p=0.2), None, "inconclusive"),  # beyond it, not significant
        (_steady(1.0, 1.3, "too few samples", p=1.0), None, "inconclusive"),
        (_steady(1.0, 1.3, "slower"), {"notice": "uniform shift: ×1.3"}, "inconclusive"),  # the machine
        (_steady(1.0, 0.5, "faster"), None, "pass"),
        (_steady(0.001, 0.00104, "slower"), None, "pass"),  # ×1.04 below the ratio
        (_steady(1e-5, 2e-5, "slower"), None, "pass"),  # ×2 but 10 µs: under the 50 µs floor
    ],
)
def test_statistical_rule_fails_only_on_significant_changes_beyond_ratio_and_floor(
    steady: dict[str, Any], shift: dict[str, Any] | None, status: str
) -> None:
    rule = rules.Rule("steps.steady", max_ratio=1.10, floor=5e-5)
    (outcome,) = rules.evaluate(rules.Config([rule]), _result(steady, shift), has_baseline=True)
    assert outcome.status == status, outcome.seen
    assert outcome.message.startswith("steps.steady: allowed at most 10% slower")


def test_timing_rules_need_a_baseline() -> None:
    rule = rules.Rule("steps.steady", max_ratio=1.10)
    (outcome,) = rules.evaluate(rules.Config([rule]), _result(_steady(1.0, 9.0, "slower")), has_baseline=False)
    assert outcome.status == "skipped"


def test_github_annotations_escape_and_stop_at_ten() -> None:
    items = [
        Finding("ops", "error", f"op {i}, slow: really", f"50% slower\nline two {i}", "src/a,b.py", 10 + i)
        for i in range(12)
    ] + [Finding("ops", "warning", "w", "warned")]
    lines = ci_output.github_annotations(items)
    assert len(lines) == 11
    assert lines[0] == "::error file=src/a%2Cb.py,line=10,title=op 0%2C slow%3A really::50%25 slower%0Aline two 0"
    assert lines[-1].startswith("::notice title=tpudiag::3 more finding(s) not annotated (2 error, 1 warning)")


def test_step_summary_appends_and_is_capped(tmp_path: Path) -> None:
    target = tmp_path / "summary.md"
    assert ci_output.write_step_summary("# x", env={}) is None
    ci_output.write_step_summary("# first", env={"GITHUB_STEP_SUMMARY": str(target)})
    ci_output.write_step_summary("line\n" * 300_000, env={"GITHUB_STEP_SUMMARY": str(target)})
    data = target.read_bytes()
    assert data.startswith(b"# first\n") and b"(summary cut at 1000 KiB)" in data
    assert len(data) < 1024 * 1024


def test_junit_xml_counts() -> None:
    xml = ci_output.junit_xml(
        "s",
        [
            {"name": "a", "status": "pass"},
            {"name": "b <&>", "status": "fail", "message": "allowed 0, seen 1", "detail": "x"},
            {"name": "c", "status": "inconclusive", "message": "noisy"},
        ],
    )
    root = ET.fromstring(xml)
    assert (root.get("tests"), root.get("failures"), root.get("skipped")) == ("3", "1", "1")
    case = root.find("testcase[@name='b <&>']")
    assert case is not None and case.find("failure").get("message") == "allowed 0, seen 1"  # type: ignore[union-attr]


# -- runs whose input shapes differ: counts still gate, timings are inconclusive -----------------------------------
RECOMPILE = {
    "function": "forward",
    "file": "train.py",
    "line": 12,
    "reason": "tensor 'x' size mismatch at index 1. expected 8, actual 12",
    "step_index": 4,
    "failed": False,
}
SEQ_8 = ([[2, 8, 16]],)
SEQ_8_12 = ([[2, 8, 16]], [[2, 12, 16]])  # variable sequence length: the run that recompiles


def _compared(a: Snapshot, b: Snapshot) -> dict[str, Any]:
    return compare(a, b)


def test_only_timing_problems_are_listed_as_timing_problems() -> None:
    base = make_snapshot(shapes=SEQ_8)
    comp = _compared(base, make_snapshot(shapes=SEQ_8_12))["comparable"]
    assert (
        comp["problems"] == comp["timing_problems"] == ["input shapes differ: step and op times measure different work"]
    )
    other = _compared(base, make_snapshot(shapes=SEQ_8_12, script="other.py"))["comparable"]
    assert other["problems"][0].startswith("script differs") and other["timing_problems"] == other["problems"][1:]
    same = _compared(base, make_snapshot(shapes=SEQ_8))["comparable"]
    assert same["ok"] and same["problems"] == same["timing_problems"] == []


def test_shapes_differ_count_rules_decide_timing_rules_are_inconclusive() -> None:
    config = rules.Config(
        [
            rules.Rule("compile.recompiles_after_warmup", max_increase=0),
            rules.Rule("steps.steady", max_ratio=1.10, floor=5e-5),
            rules.Rule("compile.compile_time", max_ratio=1.5),
            rules.Rule("ops.time", max_ratio=1.10),
        ]
    )
    # B: the sequence length varies, a recompile after warm-up, and steps twice as long (more work, not slower code).
    result = _compared(make_snapshot(shapes=SEQ_8), make_snapshot(0.1, shapes=SEQ_8_12, recompiles=[RECOMPILE]))
    by = {o.rule.metric: o for o in rules.evaluate(config, result, has_baseline=True)}
    rec = by["compile.recompiles_after_warmup"]
    assert rec.status == "fail" and rec.seen == "1 (baseline 0)"
    assert rec.where == f"forward at train.py:12: {RECOMPILE['reason']}" and (rec.file, rec.line) == ("train.py", 12)
    steady = by["steps.steady"]
    assert steady.status == "inconclusive" and steady.reason is not None
    assert steady.reason.startswith("input shapes differ: step and op times measure different work")
    assert "--allow-mismatch" in steady.reason and "×2" in steady.seen  # what was measured is still shown
    assert "inconclusive: input shapes differ" in steady.message and steady.severity == "warning"
    assert steady.to_dict()["reason"] == steady.reason and steady.to_dict()["status"] == "inconclusive"
    assert by["compile.compile_time"].status == "inconclusive"
    assert by["ops.time"].status == "inconclusive"  # no ops in these snapshots: not even a pass
    # --allow-mismatch: timing rules are applied as they are when the shapes match.
    allowed = {o.rule.metric: o for o in rules.evaluate(config, result, True, allow_mismatch=True)}
    assert allowed["steps.steady"].status == "fail" and allowed["steps.steady"].reason is None
    assert allowed["compile.compile_time"].status == "pass"
    assert allowed["compile.recompiles_after_warmup"].status == "fail"
    # The same shapes and the same B: the timing rule decides (fails) by itself.
    same = _compared(make_snapshot(shapes=SEQ_8), make_snapshot(0.1, shapes=SEQ_8, recompiles=[RECOMPILE]))
    by_same = {o.rule.metric: o for o in rules.evaluate(config, same, has_baseline=True)}
    assert by_same["steps.steady"].status == "fail"
    # A run without a recompile after warm-up (the first step's compile is warm-up) passes the count rule.
    early = dict(RECOMPILE, step_index=0)
    quiet = _compared(make_snapshot(shapes=SEQ_8), make_snapshot(shapes=SEQ_8_12, recompiles=[early]))
    by_quiet = {o.rule.metric: o for o in rules.evaluate(config, quiet, has_baseline=True)}
    assert by_quiet["compile.recompiles_after_warmup"].status == "pass"
    assert by_quiet["steps.steady"].status == "inconclusive"


def _check(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)  # no ./pyproject.toml: the default rules
        mp.delenv("GITHUB_STEP_SUMMARY", raising=False)
        for k, v in (env or {}).items():
            mp.setenv(k, v)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["check", *args, "--db", str(tmp_path / "store.duckdb")])
    return code, out.getvalue(), err.getvalue()


def test_check_cli_gates_counts_when_shapes_differ(tmp_path: Path) -> None:
    base, run, calm, other = (tmp_path / f"{n}.json" for n in ("base", "run", "calm", "other"))
    snapshot.save(make_snapshot(name="base", shapes=SEQ_8), base)
    snapshot.save(make_snapshot(0.1, name="run", shapes=SEQ_8_12, recompiles=[RECOMPILE]), run)
    snapshot.save(make_snapshot(name="calm", shapes=SEQ_8_12), calm)
    snapshot.save(make_snapshot(name="other", shapes=SEQ_8, script="other.py"), other)

    code, out, err = _check(tmp_path, str(run), "--baseline", str(base))
    assert code == 1, out + err
    lines = out.splitlines()
    (fail,) = [ln for ln in lines if ln.startswith("FAIL")]
    assert "compile.recompiles_after_warmup" in fail and "size mismatch at index 1" in fail
    (undecided,) = [ln for ln in lines if ln.startswith("INCONCLUSIVE")]
    assert "steps.steady" in undecided and "inconclusive: input shapes differ" in undecided
    # 1 skipped: memory.peak (these snapshots hold no memory figures)
    assert "FAILED (1 fail, 1 inconclusive, 2 pass, 1 skipped" in lines[-1]

    # No count rule fails: the gate says it could not decide on timing (3), never "not comparable" (2).
    code, out, _ = _check(tmp_path, str(calm), "--baseline", str(base))
    assert code == 3 and "INCONCLUSIVE (0 fail, 1 inconclusive, 3 pass" in out.splitlines()[-1]

    code, out, _ = _check(tmp_path, str(run), "--baseline", str(base), "--json")
    data = json.loads(out)
    assert code == 1 and data["verdict"] == "failed"
    assert data["timing_not_comparable"] == ["input shapes differ: step and op times measure different work"]
    by = {o["metric"]: o for o in data["outcomes"]}
    assert by["steps.steady"]["status"] == "inconclusive" and "input shapes differ" in by["steps.steady"]["reason"]
    assert (
        by["compile.recompiles_after_warmup"]["status"] == "fail"
        and by["compile.recompiles_after_warmup"]["reason"] is None
    )

    summary = tmp_path / "summary.md"
    code, out, _ = _check(
        tmp_path, str(run), "--baseline", str(base), "--format", "github", env={"GITHUB_STEP_SUMMARY": str(summary)}
    )
    warning = next(ln for ln in out.splitlines() if ln.startswith("::warning "))
    assert "title=steps.steady inconclusive::" in warning and "inconclusive: input shapes differ" in warning
    assert next(ln for ln in out.splitlines() if ln.startswith("::error ")).startswith("::error file=train.py,line=12,")
    md = summary.read_text()
    assert "**Inconclusive**: steps.steady: input shapes differ" in md
    assert "| inconclusive | steps.steady |" in md and "| fail | compile.recompiles_after_warmup |" in md

    # --allow-mismatch times them anyway: twice as long a step fails the timing rule too.
    code, out, _ = _check(tmp_path, str(run), "--baseline", str(base), "--allow-mismatch", "--json")
    by = {o["metric"]: o for o in json.loads(out)["outcomes"]}
    assert code == 1 and by["steps.steady"]["status"] == "fail"

    # Another script is still not comparable at all.
    code, _, err = _check(tmp_path, str(other), "--baseline", str(base))
    assert code == 2 and "runs not comparable: script differs" in err and err.count("\n") == 1
