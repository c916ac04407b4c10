"""The gate's rules (pyproject parsing, evaluation on comparison results) and the CI output channels."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tpudiag.comparison import ci_output, rules
from tpudiag.comparison.compare import Finding
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
