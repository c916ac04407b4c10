"""Dependencies that fit: the core install carries what capture, report, export and the dashboard import, and
nothing only a viewer or a benchmark needs; torch is not capped for CUDA/CPU users (torch-tpu's range comes with
the ``tpu`` extra)."""

from __future__ import annotations

import ast
import re
import tomllib

from tests.conftest import REPO, run_tpudiag

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VIEWERS = {"tensorboard", "xprof"}


def _names(requirements: list[str]) -> dict[str, str]:
    out = {}
    for req in requirements:
        m = re.match(r"([A-Za-z0-9_.\-]+)(\[[^\]]*\])?\s*(.*)", req)
        assert m, req
        out[m.group(1).lower() + (m.group(2) or "")] = m.group(3)
    return out


def test_core_requires_torch_without_a_cap_and_no_viewer_or_benchmark_package() -> None:
    core = _names(PROJECT["dependencies"])
    assert core["torch"] == ">=2.11"
    assert not (VIEWERS | {"jax", "holistictraceanalysis", "torch-tpu"}) & set(core)
    extras = {k: _names(v) for k, v in PROJECT["optional-dependencies"].items()}
    assert set(extras["tensorboard"]) == VIEWERS
    assert set(extras["tpu"]) == {"torch-tpu"}
    assert "holistictraceanalysis" in extras["bench"] and "tpudiag[tensorboard]" in extras["bench"]
    # The tests open exports with xprof and TensorBoard: dev pulls the viewer extra; jax is imported nowhere.
    assert "tpudiag[tensorboard]" in extras["dev"] and "jax" not in extras["dev"]


def test_nothing_installed_by_default_imports_a_viewer_package() -> None:
    for folder in ("tpudiag", "collectors", "app"):
        for path in (REPO / folder).rglob("*.py"):
            if folder == "tpudiag" and path.relative_to(REPO / "tpudiag").parts[0] in ("collectors", "app"):
                continue  # symlinks to the top-level folders, scanned there
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    mods = [node.module or ""]
                else:
                    continue
                for mod in mods:
                    assert mod.split(".")[0] not in VIEWERS | {"jax", "hta"}, f"{path}: imports {mod}"


def test_tensorboard_export_says_how_to_install_the_viewer(db, tmp_path) -> None:
    from tests.factories import make_event, make_run, store_with
    from tpudiag.model import TraceEvent
    from tpudiag.store import Store

    run = make_run()
    store_with(Store(db), run, {TraceEvent: [make_event(run.id, 0, "aten::mm", 0, 10)]})
    out = tmp_path / "logs"
    proc = run_tpudiag("export", "--db", str(db), run.id, "--format", "tensorboard", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"tensorboard --logdir {out}" in proc.stderr
    assert 'pip install "tpudiag[tensorboard]"' in proc.stderr
