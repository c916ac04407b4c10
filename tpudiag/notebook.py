"""IPython / Jupyter: ``%load_ext tpudiag`` gives the ``%%tpudiag`` cell magic.

    %%tpudiag --name warmup --collect trace,numerics --numerics all
    for step in range(10):
        train_step()

The cell runs in the notebook's namespace under ``tpudiag.capture`` (same session, collectors and store as
``tpudiag capture``); the magic returns the run, which displays itself (``CapturedRun._repr_html_``).  An
exception in the cell propagates as without the magic, and the run is stored as ``failed``.  Options:
``--name``, ``--db``, ``--collect``, ``--numerics``, ``--budget`` (as ``tpudiag capture``'s).  marimo has no magics:
use ``with tpudiag.capture() as run:`` in a cell and show ``run``.
"""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from tpudiag.api import Capture, CapturedRun
from tpudiag.errors import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # a bad option is one clear line, not SystemExit inside the kernel
        raise UsageError(f"%%tpudiag: {message}")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%tpudiag", add_help=False)
    p.add_argument("--name")
    p.add_argument("--db")
    p.add_argument("--collect")
    p.add_argument("--numerics")
    p.add_argument("--budget", type=float)
    return p


def run_cell_captured(shell: Any, line: str, cell: str) -> CapturedRun:
    """Run ``cell`` in ``shell``'s namespace under a capture; the run (stored before this returns)."""
    args = _parser().parse_args(shlex.split(line))
    capture = Capture(
        name=args.name or "cell", db=args.db, collect=args.collect, numerics=args.numerics, budget=args.budget
    )
    source = shell.transform_cell(cell)
    try:  # the file name IPython gives the cell (in linecache): tracebacks and source lines show the cell's code
        filename = shell.compile.cache(source, shell.execution_count)
    except Exception:
        filename = "<tpudiag cell>"
    code = compile(source, filename, "exec")
    with capture as run:
        exec(code, shell.user_ns)
    return run


def load_ipython_extension(ipython: Any) -> None:
    def tpudiag(line: str, cell: str) -> CapturedRun:
        return run_cell_captured(ipython, line, cell)

    ipython.register_magic_function(tpudiag, magic_kind="cell", magic_name="tpudiag")
