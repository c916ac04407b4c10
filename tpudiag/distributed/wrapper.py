"""The interpreter an elastic agent starts workers with, under capture: a two-line shell wrapper in the run folder
that runs ``python -u -m tpudiag.distributed.worker <the worker's arguments>``, and the environment that points
``PYTHON_EXEC`` at it and hands the run over to the workers (``session.WorkerConfig``).

Light on purpose: every capture sets it up before its script runs (``tpudiag.distributed.reach``), as
``tpudiag capture torchrun`` does (``tpudiag.distributed.launch``).
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterator
from pathlib import Path

from tpudiag.distributed.session import CONFIG_ENV, ORIGINAL_PYTHON_EXEC_ENV, WorkerConfig


def write_wrapper(run_dir: Path, python: str, node: str = "") -> Path:
    """The interpreter torchrun starts workers with: tpudiag's worker module on the same (or the user's) Python
    (one per node of a multi-node job: their Pythons may differ)."""
    path = run_dir / "bin" / ("python-worker" + (f"-{node}" if node else ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(python)} -u -m tpudiag.distributed.worker "$@"\n')
    path.chmod(0o755)
    return path


@contextlib.contextmanager
def worker_environment(config: WorkerConfig, wrapper: Path) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in (CONFIG_ENV, ORIGINAL_PYTHON_EXEC_ENV, "PYTHON_EXEC")}
    if saved["PYTHON_EXEC"]:
        os.environ[ORIGINAL_PYTHON_EXEC_ENV] = saved["PYTHON_EXEC"] or ""
    os.environ[CONFIG_ENV] = config.to_env()
    os.environ["PYTHON_EXEC"] = str(wrapper)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
