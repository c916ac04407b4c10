"""Under CI a skip must not hide a broken install: only the reasons CI_ALLOWED_SKIPS lists stay skips."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

TESTS = """
import pytest

def test_no_fixtures():
    pytest.skip("../shared/fixtures is absent")

@pytest.mark.skipif(True, reason="no Python with torch-tpu (set TPUDIAG_TPU_PYTHON)")
def test_no_torch_tpu():
    pass

def test_missing_package():
    pytest.importorskip("surely_not_installed_pkg")

def test_missing_browser():
    pytest.skip("no chromium on PATH")

@pytest.mark.xfail(reason="known")
def test_expected_failure():
    assert False

def test_plain():
    assert True
"""


def _run(tmp_path: Path, ci: str | None) -> str:
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_runtest_makereport  # noqa: F401\n")
    (tmp_path / "test_sample.py").write_text(TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = str(REPO)
    if ci is not None:
        env["CI"] = ci
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "test_sample.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.stdout.splitlines()[-1]


def test_under_ci_only_the_allowed_reasons_skip(tmp_path: Path) -> None:
    assert _run(tmp_path, "true").split(" in ")[0] == "2 failed, 1 passed, 2 skipped, 1 xfailed"


def test_outside_ci_every_skip_stays_a_skip(tmp_path: Path) -> None:
    assert _run(tmp_path, None).split(" in ")[0] == "1 passed, 4 skipped, 1 xfailed"
