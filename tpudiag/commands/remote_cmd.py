"""``tpudiag gather URL`` and ``tpudiag upload RUN``: runs in object storage (``tpudiag.remote``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tpudiag.errors import TpudiagError, UsageError


def register_gather(sub: Any) -> None:
    p = sub.add_parser(
        "gather",
        help="merge a run's shards from a bucket (gs://, s3://, file://) into the local store",
        description="Download a run's per-rank shards (every node, every rank) from the bucket that "
        "`tpudiag capture --remote URL` uploaded them to, and merge them into one run of the local store. "
        "Repeatable while the job runs: objects already here are skipped.",
    )
    p.add_argument("url", help="the --remote URL the job uploaded to")
    p.add_argument("--run", help="run id in the bucket (default: the newest)")
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")
    p.add_argument(
        "--raw",
        action="store_true",
        help="also download the run's raw files (trace windows, XPlanes, repro bundles) into <run folder>/raw/<node>/",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_gather)


def register_upload(sub: Any) -> None:
    p = sub.add_parser(
        "upload",
        help="retry uploading what a run could not upload to its --remote bucket",
        description="Upload a run folder's remaining files to the bucket its capture named (--remote), "
        "then its completion marker; `tpudiag runs` lists runs with files left.",
    )
    p.add_argument("run", help="run id or unique name")
    p.add_argument("--db", help="store path (default: $TPUDIAG_DB or ./tpudiag.duckdb)")
    p.add_argument("--give-up-s", type=float, default=120.0, help="stop retrying after this many seconds")
    p.set_defaults(func=cmd_upload)


def cmd_gather(args: argparse.Namespace, rest: list[str]) -> int:
    from tpudiag.remote.gather import gather
    from tpudiag.remote.location import parse
    from tpudiag.store import Store, resolve_db_path

    remote = parse(args.url)
    store = Store(resolve_db_path(args.db))
    result = gather(store, remote, args.run, raw=args.raw)
    if args.json:
        print(json.dumps(result.__dict__, indent=2))
        return 0
    lost = f"; no completion marker: {', '.join(result.unfinished)}" if result.unfinished else ""
    print(
        f"run {result.run_id} ({result.status}): {result.nodes} node(s), {result.downloaded} shard part(s) "
        f"downloaded, {result.skipped} already here{lost}; stored in {store.path}"
    )
    if result.raw_dir is not None:
        print(f"raw files: {result.raw_downloaded} downloaded, {result.raw_skipped} already here, in {result.raw_dir}")
    return 0


def cmd_upload(args: argparse.Namespace, rest: list[str]) -> int:
    from tpudiag.remote.uploader import UploadConfig, Uploader, folder
    from tpudiag.store import Store, queries, resolve_db_path

    store = Store(resolve_db_path(args.db))
    run = queries.resolve_run(store, args.run)
    run_dir = Path(run["artifacts_dir"] or store.run_dir(run["id"]))
    if not (folder(run_dir) / "config.json").is_file():
        raise UsageError(f"run {run['id']} was not captured with --remote: nothing to upload")
    config = UploadConfig.load(run_dir)
    end = folder(run_dir) / "events" / "end.json"
    outcome = json.loads(end.read_text()) if end.is_file() else None
    ok = Uploader(run_dir, config, give_up_s=args.give_up_s).finish(outcome)
    if not ok:
        raise TpudiagError(f"run {run['id']}: some files are still not uploaded to {config.url} (see tpudiag runs)")
    sys.stdout.write(f"run {run['id']}: every file is in {config.url}\n")
    return 0
