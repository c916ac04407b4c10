from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# torch 2.13's gloo sometimes aborts a rank as the process exits, after the script's work and output are done
# ("terminate called without an active exception", exit -6), in plain runs as in captured ones; a barrier before
# ``destroy_process_group`` makes it rarer, not impossible (seen in a plain run of test_distributed_rank_numerics).
GLOO_EXIT_ABORT = "terminate called without an active exception"


def run_plain_reference(
    cmd: list[str], cwd: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """A plain (uncaptured) reference run of a distributed job, run once more if torch's gloo aborted it at exit:
    the reference is torch's business; the captured run is never retried."""
    plain = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if plain.returncode != 0 and GLOO_EXIT_ABORT in plain.stderr:
        plain = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return plain


@pytest.fixture
def faulty_tanh() -> Iterator[None]:
    """aten::tanh on CPU float32 off by 3e-3 relative (float64 stays exact): a planted divergence."""
    import torch

    lib = torch.library.Library("aten", "IMPL")

    def kernel(x: Any) -> Any:
        exact = torch.where(x.abs() > 20, x.sign(), torch.sinh(x.double()) / torch.cosh(x.double()))
        return (exact * (1 + 3e-3)).float() if x.dtype == torch.float32 else exact.to(x.dtype)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lib.impl("tanh", kernel, "CPU")
    yield
    lib._destroy()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "store.duckdb"


@pytest.fixture
def shared_fixtures() -> Path:
    if not SHARED_FIXTURES.is_dir():
        pytest.skip("../shared/fixtures is absent")
    return SHARED_FIXTURES


# Under CI (CI=true, as .ci/run is run) a skip is a failure unless its reason is one a CI machine may really have:
# no ../shared next to the clone, no second interpreter with torch-tpu, no accelerator.  Everything else (a missing
# package, a missing browser) is a broken install that must not pass as green.
CI_ALLOWED_SKIPS = (
    "../shared/fixtures is absent",
    "no Python with torch-tpu",
    "needs a CUDA or TPU device",
    "no accelerator",
)


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


def skip_allowed_in_ci(reason: str) -> bool:
    return any(allowed in reason for allowed in CI_ALLOWED_SKIPS)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if os.environ.get("CI") == "true" and report.skipped and not hasattr(report, "wasxfail"):
        reason = skip_reason(report)
        if not skip_allowed_in_ci(reason):
            report.outcome = "failed"
            report.longrepr = f"skipped under CI=true for a reason CI does not allow ({reason}): fix the install"


def script_env(tmp: Path, name: str, **extra: str) -> dict[str, str]:
    """The environment a behaviour comparison runs a script in, plain or captured: its own Inductor cache, no hub,
    a fixed hash seed, one CPU thread, and no store from the caller's environment.

    One thread: Inductor's CPU kernels accumulate some backward sums (an embedding's gradient) with atomic adds
    across threads, so with several threads plain Python itself gives different bits from run to run (seen: one
    plain run of the compiled decoder out of four, under CI's load, while three plain runs and the captured one
    agreed), and a bitwise comparison would blame the capture."""
    env = dict(os.environ)
    env.pop("TPUDIAG_DB", None)
    env.update(
        {
            "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{name}"),
            "HF_HUB_OFFLINE": "1",
            "PYTHONHASHSEED": "0",
            "TPUDIAG_LOCK_TIMEOUT": "60",
            "OMP_NUM_THREADS": "1",
            **extra,
        }
    )
    return env


def steps_and_windows(db: Path) -> tuple[list[int], list[tuple[str, int, int | None]], int]:
    """A captured run's pulse steps, its trace windows as (reason, first step, last step), and the optimizer steps
    its first window traced (``Optimizer.step`` events)."""
    import duckdb

    from tpudiag.longrun.analyst import EVENT_ID_STRIDE

    con = duckdb.connect(str(db), read_only=True)
    try:
        steps = [r[0] for r in con.execute("SELECT step FROM pulse ORDER BY step").fetchall()]
        windows = con.execute("SELECT reason, first_step, last_step FROM trace_windows ORDER BY window_id").fetchall()
        first = con.execute(
            "SELECT count(*) FROM trace_events WHERE name LIKE 'Optimizer.step#%' AND event_id < ?", [EVENT_ID_STRIDE]
        ).fetchone()
    finally:
        con.close()
    return steps, windows, first[0] if first else 0


def without_tpudiag_lines(text: str) -> list[str]:
    """A script's stderr without tpudiag's own lines: what must equal plain Python's."""
    return [line for line in text.splitlines() if not line.startswith(("tpudiag:", "tpudiag numerics:"))]
