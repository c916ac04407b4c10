"""A real notebook run by a real Jupyter kernel (nbclient + ipykernel, the kernelspec pointing at this
interpreter, no network): the ``%%tpudiag`` cell magic and the context manager capture training cells, the runs
land in the store, and each finished run displays itself as HTML."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import nbformat
import pytest
from nbclient import NotebookClient

from tests.conftest import run_tpudiag

KERNEL = "tpudiag-test-python"

SETUP = """
import torch, tpudiag

def train(steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.ones(4, 8)).pow(2).mean().backward()
        opt.step()
    return model
"""


# A planted wrong float32 tanh (the float64 oracle stays exact), for the length of the cell.
BROKEN_TANH = """lib = torch.library.Library("aten", "IMPL")
def kernel(x):
    exact = torch.where(x.abs() > 20, x.sign(), torch.sinh(x) / torch.cosh(x))
    return exact * (1 + 3e-3) if x.dtype == torch.float32 else exact
lib.impl("tanh", kernel, "CPU")
try:
    train(1)
finally:
    lib._destroy()
"""


def _notebook(db: Path) -> nbformat.NotebookNode:
    cells = [
        nbformat.v4.new_code_cell("%load_ext tpudiag"),
        nbformat.v4.new_code_cell(SETUP),
        nbformat.v4.new_code_cell(
            f"%%tpudiag --name magic_cell --db {db} --collect trace,numerics --numerics all\nmodel = train(3)"
        ),
        nbformat.v4.new_code_cell(
            f"with tpudiag.capture(name='ctx_cell', db={str(db)!r}, collect='trace') as run:\n    train(2)\nrun"
        ),
        nbformat.v4.new_code_cell(
            f"%%tpudiag --name bad_cell --db {db} --collect trace\ntrain(1)\nraise ValueError('boom in a cell')"
        ),
        nbformat.v4.new_code_cell("print(type(model).__name__, run.id, run.status)"),
        nbformat.v4.new_code_cell(
            f"%%tpudiag --name diverging --db {db} --collect numerics --numerics all\n" + BROKEN_TANH
        ),
    ]
    cells[4].metadata["tags"] = ["raises-exception"]
    return nbformat.v4.new_notebook(cells=cells)


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> tuple[nbformat.NotebookNode, Path]:
    tmp = tmp_path_factory.mktemp("notebook")
    spec = tmp / "jupyter" / "kernels" / KERNEL
    spec.mkdir(parents=True)
    argv = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": KERNEL, "language": "python"}))
    mp = pytest.MonkeyPatch()
    mp.setenv("JUPYTER_PATH", str(tmp / "jupyter"))
    mp.setenv("JUPYTER_DATA_DIR", str(tmp / "jupyter"))
    mp.setenv("IPYTHONDIR", str(tmp / "ipython"))
    db = tmp / "nb.duckdb"
    nb = _notebook(db)
    try:
        NotebookClient(nb, kernel_name=KERNEL, timeout=600, resources={"metadata": {"path": str(tmp)}}).execute()
    finally:
        mp.undo()
    return nb, db


def _html(cell: Any) -> str:
    out = [o for o in cell.outputs if o.output_type == "execute_result" and "text/html" in o.data]
    assert len(out) == 1, cell.outputs
    return str(out[0].data["text/html"])


def _runs(db: Path) -> dict[str, dict[str, Any]]:
    proc = run_tpudiag("runs", "--json", "--db", str(db))
    assert proc.returncode == 0, proc.stderr
    return {r["name"]: r for r in json.loads(proc.stdout)}


def test_the_cell_magic_stores_the_cell_and_displays_the_run(executed: tuple[nbformat.NotebookNode, Path]) -> None:
    nb, db = executed
    runs = _runs(db)
    magic = runs["magic_cell"]
    assert magic["status"] == "ok" and magic["collectors"] == ["trace", "numerics"]
    html = _html(nb.cells[2])
    assert f"tpudiag run <code>{magic['id']}</code>" in html and "magic_cell" in html
    assert "slowest ops by self time" in html and "aten::addmm" in html
    assert "plotly" in html.lower()  # the dashboard's bar chart, plotly.js inline
    assert "numerics" in html and "op call(s) checked" in html
    report = json.loads(run_tpudiag("report", "--json", "--db", str(db), magic["id"]).stdout)
    assert report["numerics"]["coverage"]["ops_checked"] > 0
    assert not [
        o for o in nb.cells[2].outputs if o.output_type == "stream" and o.name == "stderr" and "Error" in o.text
    ]


def test_the_context_manager_in_a_cell_stores_and_displays_the_run(
    executed: tuple[nbformat.NotebookNode, Path],
) -> None:
    nb, db = executed
    ctx = _runs(db)["ctx_cell"]
    assert ctx["status"] == "ok"
    assert f"tpudiag run <code>{ctx['id']}</code>" in _html(nb.cells[3])
    last = [o for o in nb.cells[5].outputs if o.output_type == "stream"]
    assert last and last[0].text.split() == ["Sequential", ctx["id"], "ok"]  # the namespace kept the cell's names


def test_a_divergence_shows_its_op_module_and_source_line(executed: tuple[nbformat.NotebookNode, Path]) -> None:
    nb, db = executed
    run = _runs(db)["diverging"]
    html = _html(nb.cells[6])
    first = json.loads(run_tpudiag("report", "--json", "--db", str(db), run["id"]).stdout)["numerics"]
    first = first["first_divergence"]
    assert first["op"] == "aten::tanh"
    shown = f"<b>aten::tanh</b> in module <code>{first['module']}</code> at <code>{first['source_short']}</code>"
    assert "numerics: first divergence" in html and shown in html
    assert re.search(r":\d+$", first["source_short"]), first  # a source line, in the notebook's own cell


def test_an_exception_in_a_magic_cell_is_the_cells_error_and_a_failed_run(
    executed: tuple[nbformat.NotebookNode, Path],
) -> None:
    nb, db = executed
    errors = [o for o in nb.cells[4].outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "ValueError" and errors[0].evalue == "boom in a cell"
    bad = _runs(db)["bad_cell"]
    assert bad["status"] == "failed" and "block ended with ValueError: boom in a cell" in bad["notes"]


MARIMO_APP = """
import marimo

app = marimo.App()


@app.cell
def _():
    import torch
    import tpudiag

    return torch, tpudiag


@app.cell
def _(torch, tpudiag):
    with tpudiag.capture(name="marimo_cell", db=DB, collect="trace") as run:
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        for _ in range(3):
            model(torch.ones(4, 8)).pow(2).mean().backward()
    run
    return (run,)
"""

MARIMO_DRIVER = """
import importlib.util, json, sys
import marimo
spec = importlib.util.spec_from_file_location("nb", sys.argv[1])
nb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nb)
outputs, defs = nb.app.run()
run = defs["run"]
print(json.dumps({"id": run.id, "html": marimo.as_html(run).text, "mime": run._mime_()[0]}))
"""


def test_marimo_displays_a_run_captured_in_a_cell(tmp_path: Path) -> None:
    pytest.importorskip("marimo")
    import subprocess

    db = tmp_path / "m.duckdb"
    (tmp_path / "nb.py").write_text(MARIMO_APP.replace("db=DB", f"db={str(db)!r}"))
    (tmp_path / "driver.py").write_text(MARIMO_DRIVER)
    proc = subprocess.run(
        [sys.executable, "driver.py", "nb.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["mime"] == "text/html"
    assert f"tpudiag run <code>{got['id']}</code>" in got["html"] and "slowest ops by self time" in got["html"]
    assert _runs(db)["marimo_cell"]["status"] == "ok"
