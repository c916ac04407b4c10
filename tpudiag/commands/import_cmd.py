"""``tpudiag import PATH... [--name NAME]``: a run from existing profiles (XPlane, Kineto JSON, TORCH_TRACE)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tpudiag import no_pandas

EPILOG = """accepted inputs (detected from content):
  *.xplane.pb            XSpace from TorchTPU, JAX or an XProf capture (one file per host)
  *.json, *.json.gz      Kineto / Chrome trace from torch.profiler (a folder of per-rank files works too)
  TORCH_TRACE logs       dedicated_log_torch_trace_*.log (compile and cache events)
examples:
  tpudiag import ./profile/plugins/profile/2025_01_01_12_00_00/
  tpudiag import rank-0.pt.trace.json.gz rank-1.pt.trace.json.gz --name ddp-run
"""


def register(sub: Any) -> None:
    p = sub.add_parser(
        "import",
        help="create a run from existing profiles (.xplane.pb, Kineto JSON, TORCH_TRACE logs)",
        description="Create a run (source 'import') from existing profiles. A folder is searched for trace "
        "files; bad files among good ones are reported and skipped.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files or folders")
    p.add_argument("--name", help="name of the run (default: the first file's name)")
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")
    p.set_defaults(func=cmd_import)


def cmd_import(args: argparse.Namespace, rest: list[str]) -> int:
    no_pandas.skip()  # (pyarrow's pandas check: see tpudiag.no_pandas)
    from tpudiag.importer import import_paths
    from tpudiag.store_access import open_store

    store = open_store(args.db)
    result = import_paths(store, [Path(p) for p in args.paths], name=args.name)
    for _path, why in result.failed:
        sys.stderr.write(f"tpudiag: warning: skipped {why}\n")
    what = f"{result.events:,} trace events"
    if result.compile_events:
        what += f", {result.compile_events:,} compile events"
    sys.stderr.write(
        f"tpudiag: run {result.run_id} imported from {len(result.imported)} file(s) ({what}) into {store.path}\n"
    )
    print(result.run_id)
    return 0
