"""The pytest plugin on small real tests, run by pytest itself (``pytester``) in a subprocess, with and without
``--tpudiag``: markers and the fixture pass and fail as they should, with messages that say what was allowed,
what was seen and where.  The fault is a float32-only wrong ``aten::tanh`` kernel registered with
``torch.library`` for the length of one test."""

from __future__ import annotations

import importlib.metadata
import re
import textwrap

import pytest

from tpudiag.store import Store, queries

pytest_plugins = ("pytester",)

TESTS = textwrap.dedent(
    """
    import pytest
    import torch

    RUNS = {}


    @pytest.fixture
    def faulty_tanh():
        lib = torch.library.Library("aten", "IMPL")

        def kernel(x):
            exact = torch.where(x.abs() > 20, x.sign(), torch.sinh(x) / torch.cosh(x))
            return exact * (1 + 3e-3) if x.dtype == torch.float32 else exact

        lib.impl("tanh", kernel, "CPU")
        yield
        lib._destroy()


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.fc = torch.nn.Linear(16, 16)

        def forward(self, x):
            return torch.tanh(self.fc(x))  # TANH LINE


    def run_net():
        with torch.no_grad():
            return Net()(torch.randn(8, 16))


    @pytest.mark.tpudiag(numerics="clean")
    def test_marker_clean():
        run_net()


    @pytest.mark.tpudiag(numerics="clean")
    def test_marker_fault(faulty_tanh):
        run_net()


    @pytest.mark.tpudiag(max_recompiles=0)
    def test_marker_recompiles():
        f = torch.compile(lambda t: t * 2, backend="eager", dynamic=False)
        f(torch.ones(4))
        f(torch.ones(8))


    def test_fixture_clean(tpudiag):
        run_net()
        tpudiag.assert_numerics_clean()
        tpudiag.assert_no_recompiles()
        RUNS["clean"] = tpudiag.run_id


    def test_fixture_fault(tpudiag, faulty_tanh):
        run_net()
        tpudiag.assert_numerics_clean()


    def test_fixture_compare(tpudiag, faulty_tanh):
        run_net()
        result = tpudiag.compare(RUNS["clean"])
        if tpudiag.active:
            first = result["numerics"]["first_new_divergence"]
            assert (first["op"], first["module"]) == ("aten::tanh", "Net")
        else:
            assert result is None
    """
)
TANH_LINE = next(i for i, line in enumerate(TESTS.strip().splitlines(), 1) if "# TANH LINE" in line)


def test_the_plugin_is_registered_for_pytest() -> None:
    eps = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "tpudiag"]
    assert [e.value for e in eps] == ["tpudiag.pytest_plugin"]


MORE = textwrap.dedent(
    """
    import pytest
    from test_model import faulty_tanh, run_net  # noqa: F401


    @pytest.mark.tpudiag(numerics="clean")
    def test_other_worker_clean():
        run_net()


    @pytest.mark.tpudiag(numerics="clean")
    def test_other_worker_fault(faulty_tanh):
        run_net()
    """
)


def test_markers_and_fixture_with_and_without_the_flag(pytester: pytest.Pytester) -> None:
    """With --tpudiag under pytest-xdist (two workers, one file each, one shared store), then without the flag."""
    pytest.importorskip("xdist")
    pytester.makepyfile(test_model=TESTS, test_more=MORE)
    db = pytester.path / "runs.duckdb"
    on = pytester.runpytest_subprocess(
        "--tpudiag",
        f"--tpudiag-db={db}",
        "-p",
        "no:cacheprovider",
        "-rA",
        "-n",
        "2",
        "--dist",
        "loadfile",
        timeout=400,
    )
    on.assert_outcomes(passed=4, failed=4)
    out = on.stdout.str()
    failed = set(re.findall(r"^FAILED test_model.py::(\w+)", out, re.M))
    assert failed == {"test_marker_fault", "test_marker_recompiles", "test_fixture_fault"}
    assert "FAILED test_more.py::test_other_worker_fault" in out
    # Failures read like pytest's own: allowed, seen, where (op, module, source line), and the run to open.
    assert "tpudiag: numerics not clean: allowed 0 divergent ops, seen 1" in out
    assert f"aten::tanh in Net at test_model.py:{TANH_LINE}" in out
    assert "tpudiag: allowed at most 0 recompile(s), seen 1" in out and "size mismatch" in out
    assert f"in {db} (tpudiag report --db {db} " in out
    # Both workers wrote into the one store (DuckDB takes one writer at a time; tpudiag retries), the controller
    # sums their runs.
    assert f"tpudiag: 8 run(s) stored in {db}" in out
    runs = queries.list_runs(Store(db))
    assert len({r["pid"] for r in runs}) == 2  # two worker processes
    assert sorted(r["name"].split("::")[1] for r in runs) == sorted(
        re.findall(r"^(?:PASSED|FAILED) test_\w+\.py::(\w+)", out, re.M)
    )
    assert "During handling of the above exception" not in out

    # Without --tpudiag, markers and the fixture do nothing (the compile test is left out: it only costs time).
    # A subprocess again: the fault's kernel must never be registered in this process.
    off = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", "not recompiles", timeout=400)
    off.assert_outcomes(passed=7, deselected=1)
    assert "tpudiag:" not in off.stdout.str()
