"""``tpudiag export RUN --format tensorboard|perfetto|parquet --out DIR``: a run in another tool's format."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tpudiag.errors import UsageError
from tpudiag.exporters import ExportOptions, exporter_specs, load_exporter
from tpudiag.store import queries
from tpudiag.store_access import open_store

TENSORBOARD_INSTALL = 'pip install "tpudiag[tensorboard]"'
EPILOG = """formats:
  tensorboard  OUT/plugins/profile/<run>/<host>.xplane.pb: tensorboard --logdir OUT (profile plugin / XProf)
  perfetto     OUT/<run>.trace.json[.gz]: open in ui.perfetto.dev or chrome://tracing
  parquet      OUT/<table>.parquet for each table of the run: DuckDB, pandas, Spark
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a run for TensorBoard/XProf, Perfetto/Chrome tracing or as Parquet files",
        description="Write a stored run in a format other tools open.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")
    p.add_argument("run", nargs="?", help="run id, unique name, or omitted for the latest run")
    p.add_argument("--format", "-f", required=True, choices=sorted(exporter_specs()), help="output format")
    p.add_argument("--out", "-o", required=True, help="output directory (created if missing)")
    p.add_argument("--gzip", action="store_true", help="perfetto: write a gzip-compressed .json.gz")
    p.add_argument(
        "--no-original",
        action="store_true",
        help="tensorboard: do not copy the run's original .xplane.pb files beside the export",
    )
    p.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace, rest: list[str]) -> int:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    store = open_store(args.db)
    run = queries.resolve_run(store, args.run)
    exporter = load_exporter(args.format)
    options = ExportOptions(gzip=args.gzip, include_original=not args.no_original)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create --out {out}: {err.strerror}") from None
    try:
        paths = exporter.export(store, run, out, options)
    except OSError as err:
        raise UsageError(f"export to {out} failed: {err.strerror or err}") from None
    for path in paths:
        print(path)
    if args.format == "tensorboard":
        sys.stderr.write(
            f"tpudiag: open with: tensorboard --logdir {out}  (viewer not installed? {TENSORBOARD_INSTALL})\n"
        )
    return 0
