"""``tpudiag trigger RUN [--steps N] [--numerics all]``: open a trace window in a running capture (see
tpudiag/longrun/manual.py)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tpudiag.longrun import manual
from tpudiag.store import resolve_db_path


def cmd_trigger(args: argparse.Namespace, rest: list[str]) -> int:
    if args.steps is not None and args.steps < 1:
        from tpudiag.errors import UsageError

        raise UsageError("trigger: --steps must be at least 1")
    folder = manual.run_folder(resolve_db_path(args.db), args.run)
    path = manual.write_request(folder, args.steps, args.numerics)
    sys.stderr.write(f"tpudiag: trigger sent to {folder.name} ({path.name}); the window opens at its next step\n")
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("trigger", help="open a trace window in a running capture (every rank reacts)")
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")
    p.add_argument("run", help="run id, run folder, or the unique name of a running run")
    p.add_argument("--steps", type=int, help="steps the window covers (default: the capture's --trigger-steps)")
    p.add_argument("--numerics", choices=["all", "sample"], help="all: check every op of the window's steps")
    p.set_defaults(func=cmd_trigger)
