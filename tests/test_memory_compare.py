"""Peak memory as a compare/check rule: +10% peak with the same input shapes fails; other shapes or other sources
are not compared (skipped, with the reason)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpudiag.comparison import rules
from tpudiag.comparison.compare import compare, findings
from tpudiag.comparison.memory_diff import memory_summary
from tpudiag.comparison.render import render_text
from tpudiag.comparison.snapshot import Snapshot, from_json

SHAPES = "[[64,64]]"


def _snap(name: str, peak: int | None, shapes: str = SHAPES, source: str = "profiler memory events") -> Snapshot:
    steps = [{"step": i, "dur_ns": 1_000_000, "kind": "optimizer", "input_shapes": shapes} for i in range(3)]
    section = None if peak is None else {"peak_bytes": peak, "source": source, "oom": None}
    return Snapshot(run={"id": name, "name": name}, steps=steps, memory=memory_summary(section, steps))


def _memory_outcome(a: Snapshot, b: Snapshot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> rules.Outcome:
    monkeypatch.chdir(tmp_path)  # the default rules, not a pyproject's
    config = rules.load_config(None)
    result = compare(a, b)
    [outcome] = [o for o in rules.evaluate(config, result, True) if o.rule.metric == "memory.peak"]
    return outcome


def test_peak_growth_beyond_ten_percent_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a = _snap("a", 100 << 20)
    assert _memory_outcome(a, _snap("b", 109 << 20), tmp_path, monkeypatch).status == "pass"
    grown = _snap("b", 120 << 20)
    outcome = _memory_outcome(a, grown, tmp_path, monkeypatch)
    assert outcome.status == "fail" and "×1.200" in outcome.seen
    assert any(f.section == "memory" and f.severity == "error" for f in findings(compare(a, grown)))
    assert "Memory" in render_text(compare(a, grown))


def test_other_shapes_other_sources_or_no_memory_are_not_compared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = _snap("a", 100 << 20)
    bigger_batch = _memory_outcome(a, _snap("b", 300 << 20, shapes="[[256,64]]"), tmp_path, monkeypatch)
    assert bigger_batch.status == "skipped" and "input shapes differ" in bigger_batch.seen
    rss = _memory_outcome(a, _snap("b", 300 << 20, source="process RSS"), tmp_path, monkeypatch)
    assert rss.status == "skipped" and "different sources" in rss.seen
    assert _memory_outcome(a, _snap("b", None), tmp_path, monkeypatch).status == "skipped"
    assert not [f for f in findings(compare(a, _snap("b", 300 << 20, shapes="[[256,64]]"))) if f.section == "memory"]


def test_snapshots_without_memory_still_load() -> None:
    old = {"format": "tpudiag-snapshot", "version": 1, "run": {"id": "x"}, "steps": []}
    assert from_json(old, "old.json").memory is None
