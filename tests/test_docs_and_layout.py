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
    from tpudiag.model import CompileEvent, OpDiff, OpRecord
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
    }
    assert set(SECTIONS) == set(records), "a new report section needs a case here"
    bare = make_run(collectors=[])
    store_with(store, bare, {})
    empty = report.build(store, queries.resolve_run(store, bare.id))
    for key, spec in SECTIONS.items():
        module_name, build, render = spec.split(":")
        module = importlib.import_module(module_name)
        assert empty[key] is None and getattr(module, build)(store, queries.resolve_run(store, bare.id)) is None
        run = make_run(collectors=[key])
        store_with(store, run, records[key](run.id))
        stored = queries.resolve_run(store, run.id)
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
