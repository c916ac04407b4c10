from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"
EXAMPLES = REPO / "examples"
# A second interpreter with the real torch-tpu package (never in the main environment: `import torch` would load it).
TPU_PYTHON = Path(os.environ.get("TPUDIAG_TPU_PYTHON", "/tmp/tpuvenv/bin/python"))


def run_tpudiag(
    *args: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m tpudiag ARGS`` in a subprocess, as a user would."""
    full_env = dict(os.environ)
    full_env.pop("TPUDIAG_DB", None)
    if env:
        full_env.update(env)
    return subprocess.run(
        [sys.executable, "-m", "tpudiag", *args],
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
    )


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "store.duckdb"


@pytest.fixture
def shared_fixtures() -> Path:
    if not SHARED_FIXTURES.is_dir():
        pytest.skip("../shared/fixtures is absent")
    return SHARED_FIXTURES
