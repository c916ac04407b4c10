"""The import layers of DESIGN.md section 2, and no import cycles, as pyproject's import-linter contracts say."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    return [exe, "--no-cache"]


def test_the_layers_and_acyclic_contracts_hold() -> None:
    proc = subprocess.run(_lint_imports(), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "layers of DESIGN.md section 2 KEPT" in proc.stdout
    assert "no import cycles among tpudiag's modules KEPT" in proc.stdout


def test_the_store_never_imports_the_capture_side() -> None:
    """The two cycles this contract replaced: store -> deferred_store (pending runs) and script capture <->
    launcher (option types): both would break the layers contract, checked here on the import graph itself."""
    import grimp

    graph = grimp.build_graph("tpudiag", exclude_type_checking_imports=True)
    assert graph.find_shortest_chain(importer="tpudiag.store.database", imported="tpudiag.deferred_store") is None
    assert graph.find_shortest_chain(importer="tpudiag.distributed.launch", imported="tpudiag.script_capture") is None
