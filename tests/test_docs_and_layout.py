"""Docs that cannot drift, and the installed layout: one `tpudiag` namespace, no generic top-level modules."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.conftest import REPO, run_tpudiag
from tpudiag import report
from tpudiag.cli import EXTRA_COMMANDS, build_parser
from tpudiag.plugins import available_factories
from tpudiag.report import SECTIONS

README = (REPO / "README.md").read_text()


def test_every_registered_collector_is_documented_and_loads() -> None:
    for name, spec in available_factories().items():
        assert f"`{name}`" in README, f"collector {name} is not documented in README.md"
        module_name, _, attr = spec.partition(":")
        collector = getattr(importlib.import_module(module_name), attr)()
        assert collector.name == name


def test_every_subcommand_is_documented_with_help() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert isinstance(sub.choices, dict)
    assert {"capture", "runs", "report"} <= set(sub.choices)
    assert len(sub.choices) == 3 + len(EXTRA_COMMANDS)
    top = run_tpudiag("--help")
    assert top.returncode == 0
    top_help = " ".join(top.stdout.split())
    for name, sp in sub.choices.items():
        assert f"tpudiag {name}" in README, f"`tpudiag {name}` is not in README.md"
        # Its help line is what `tpudiag --help` shows for it, and every option it takes is in the README.
        helps = {a.dest: a.help for a in sub._choices_actions}
        assert helps.get(name) and helps[name] in " ".join(top_help.split()), name
        for action in sp._actions:
            for option in action.option_strings:
                if option.startswith("--") and option != "--help":
                    assert f"{option}" in README, f"`tpudiag {name} {option}` is not in README.md"
                    assert action.help, f"`tpudiag {name} {option}` has no help text"


def test_every_report_section_is_built_into_the_report_and_rendered(tmp_path: Path) -> None:
    from tests.factories import make_run, store_with
    from tpudiag.model import CompileEvent, MemoryStep, OpDiff, OpRecord
    from tpudiag.store import Store, queries

    store = Store(tmp_path / "store.duckdb")
    records: dict[str, Callable[[str], dict[type[Any], list[Any]]]] = {
        "numerics": lambda rid: {
            OpRecord: [OpRecord(run_id=rid, seq=1, op="aten::tanh", checked=True, phase="forward", module="m")],
            OpDiff: [
                OpDiff(
                    run_id=rid,
                    seq=1,
                    output_index=0,
                    verdict="fail",
                    dtype="float32",
                    scaled_error=9e4,
                    threshold=32.0,
                    numel=4,
                )
            ],
        },
        "compile": lambda rid: {
            CompileEvent: [CompileEvent(rid, 0, "compile", function="f", file="a.py", line=3, duration_s=0.5)]
        },
        "memory": lambda rid: {
            MemoryStep: [MemoryStep(rid, 0, "sampler", 1, "cpu", rss_bytes=1 << 20, sources='{"rss_bytes": "/proc"}')]
        },
    }
    from tests.factories import make_event
    from tests.test_distributed_store import build as build_distributed_run
    from tpudiag.model import TraceEvent
    from tpudiag.store.hlo_queries import XLA_OP_CATEGORY

    records["hlo_ops"] = lambda rid: {
        TraceEvent: [
            make_event(
                rid,
                0,
                "fusion.1",
                0,
                5_000,
                source="xplane",
                process="/device:TPU:0",
                thread="XLA Ops",
                category=XLA_OP_CATEGORY,
                hlo_category="loop fusion",
                args='{"program_id": "7", "hlo_module": "jit_f"}',
            )
        ]
    }
    from tpudiag.model import PulseStep, TraceWindow

    records["pulse"] = lambda rid: {
        PulseStep: [PulseStep(run_id=rid, step=i, start_ns=i * 10**7, dur_ns=3 * 10**6, gap_ns=10**5) for i in range(9)]
    }
    records["windows"] = lambda rid: {
        TraceWindow: [
            TraceWindow(
                run_id=rid,
                window_id=0,
                reason="first_steps",
                first_step=0,
                last_step=8,
                start_ns=0,
                end_ns=10**8,
                trace_events=1,
            )
        ],
        TraceEvent: [make_event(rid, 0, "aten::addmm", 0, 5_000)],
    }
    # A distributed run is made from rank shards merged into the store, not from records of one process.
    populate: dict[str, Callable[[], str]] = {"distributed": lambda: build_distributed_run(store)}
    assert set(SECTIONS) == set(records) | set(populate), "a new report section needs a case here"
    bare = make_run(collectors=[])
    store_with(store, bare, {})
    empty = report.build(store, queries.resolve_run(store, bare.id))
    for key, spec in SECTIONS.items():
        module_name, build, render = spec.split(":")
        module = importlib.import_module(module_name)
        assert empty[key] is None and getattr(module, build)(store, queries.resolve_run(store, bare.id)) is None
        if key in populate:
            run_id = populate[key]()
        else:
            run = make_run(collectors=[key])
            store_with(store, run, records[key](run.id))
            run_id = run.id
        stored = queries.resolve_run(store, run_id)
        section = getattr(module, build)(store, stored)
        data = report.build(store, stored)
        assert section is not None and data[key] == section, key
        lines = getattr(module, render)(section)
        assert lines and all(isinstance(line, str) for line in lines), key
        assert json.loads(json.dumps(data, default=str))[key] is not None


def test_readme_opens_with_the_demo_and_the_test_command_that_ci_runs() -> None:
    blocks = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)
    assert blocks[0].startswith("python3 -m venv .venv") and "tpudiag capture examples/" in blocks[0]
    assert "pytest" in blocks[1] and "torch==2.13.0" in blocks[1]
    ci = (REPO / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in ci and 'eval "$test_cmd"' in ci
    out = subprocess.run(
        ["bash", "-c", "sed -n '/<!-- test-command -->/,/^```$/p' README.md | sed -n '/^python3 /p'"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == blocks[1]


def test_installed_as_one_namespace_without_generic_top_level_modules() -> None:
    dist = importlib.metadata.distribution("tpudiag")
    top = {Path(str(f)).parts[0] for f in dist.files or []}
    assert "collectors" not in top and "app" not in top
    for mod in ("tpudiag.collectors.trace", "tpudiag.app"):
        assert importlib.import_module(mod)
    out = subprocess.run([sys.executable, "-c", "import collectors"], capture_output=True, text=True, cwd="/")
    assert out.returncode != 0


def test_console_script_and_module_entry_agree() -> None:
    via_module = run_tpudiag("--version")
    assert via_module.returncode == 0 and via_module.stdout.startswith("tpudiag ")
    exe = Path(sys.executable).with_name("tpudiag")
    via_script = subprocess.run([str(exe), "--version"], capture_output=True, text=True)
    assert via_script.stdout == via_module.stdout


def _table(header: str) -> list[list[str]]:
    """The rows of the README table whose header line starts with ``header`` (cells stripped)."""
    lines = README[README.index(header) :].splitlines()
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def test_readme_collector_table_is_the_collectors_own_descriptions() -> None:
    rows = _table("| collector | what it records |")
    assert all(len(r) == 2 for r in rows), rows  # no other table's row pasted in
    documented = {r[0].strip("`"): r[1] for r in rows}
    builtins = {
        ep.name: ep.value
        for ep in importlib.metadata.distribution("tpudiag").entry_points
        if ep.group == "tpudiag.collectors"
    }
    described = {}
    for name, spec in builtins.items():
        module_name, _, attr = spec.partition(":")
        described[name] = getattr(importlib.import_module(module_name), attr).description
    assert documented == described


# A figure in the README: optional sign, digits (thousands commas, decimals), optional k/M multiplier.
_FIGURE = re.compile(r"(?<![\w.])([−-]?)(\d[\d,]*(?:\.\d+)?)(?:\s?(k|M)\b)?(?![\d.,])")


def _numbers(value: object) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def _shown_in(figure: tuple[str, str, str | None], measured: list[float]) -> bool:
    """Whether a README figure is one of the measured values as shown: itself, a percentage, or in thousands
    (ms <-> s), rounded to the figure's own decimals."""
    sign, digits, multiplier = figure
    shown = float(digits.replace(",", "")) * (-1 if sign else 1)
    decimals = len(digits.split(".")[1]) if "." in digits else 0
    scale = {"k": 1e3, "M": 1e6}.get(multiplier or "", 1.0)
    return any(
        round(candidate / scale, decimals) == shown for v in measured for candidate in (v, 100 * v, v / 1000, v * 1000)
    )


def test_readme_benchmark_figures_are_the_latest_results() -> None:
    rows = _table("| benchmark | what is compared | result | target |")
    assert rows and all(len(r) == 4 for r in rows), rows
    for name, _, result, _ in rows:
        path = REPO / "bench" / "results" / f"{name.strip('`')}.json"
        assert path.is_file(), f"README's benchmark row {name} has no {path.name} in bench/results"
        measured = _numbers(json.loads(path.read_text()))
        stale = [m.group(0) for m in _FIGURE.finditer(result) if not _shown_in(m.groups(), measured)]
        assert not stale, f"{name}: README figures {stale} are not in {path.name}"
