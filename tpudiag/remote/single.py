"""``tpudiag capture --remote URL script.py``: a one-process run uploaded as a one-node, one-rank job.

A single process writes its run into the store, not into rank shards, and nothing in its run folder is final
before the run is stored (the last trace chunk is analysed at the end).  So nothing is uploaded while the script
runs: ``prepare`` only notes the URL in the run folder (``upload/single.json``).  Once the run is stored (in the
capture process with ``--wait``, else in the detached child that stores it: ``deferred_store``), ``publish``

1. writes the run's rows as rank 0's shards (``shards/<table>/run_id=<id>/rank=0/``: the layout a rank writes,
   through the same ``ShardSpool``) plus its rank record (world size 1);
2. writes the node's outcome (``end.json``), then starts the uploader (``tpudiag.remote.begin``): the same process
   and object layout as a launcher's node, so it uploads the shards and the raw traces, one manifest, then
   ``complete.json``.  Nothing waits for it; a failure leaves ``upload/pending.json`` (``tpudiag upload RUN``).

``gather`` and ``report --remote`` then read the run as any job's.
"""

from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

from tpudiag.atomic_file import atomic_file
from tpudiag.model import Run, arrow_schema, bulk_tables
from tpudiag.remote import layout
from tpudiag.remote.uploader import folder
from tpudiag.store import Store

_ASKED = "single.json"
_BATCH_ROWS = 256 * 1024  # one shard part per batch: the export's memory does not grow with the run


def prepare(url: str, run_dir: Path) -> None:
    """Note the URL: whoever stores the run publishes it (``publish_if_asked``)."""
    (folder(run_dir)).mkdir(parents=True, exist_ok=True)
    with atomic_file(folder(run_dir) / _ASKED, "w") as fh:
        json.dump({"url": url}, fh)


def asked(run_dir: Path) -> str | None:
    try:
        return str(json.loads((folder(run_dir) / _ASKED).read_text())["url"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def export_shards(store: Store, run: Run, run_dir: Path) -> int:
    """The run's rows as rank 0's shard parts (attempt 0) and its rank record; returns the parts written."""
    import duckdb
    import pyarrow as pa

    from tpudiag.distributed.records import RankInfo
    from tpudiag.distributed.shards import ShardSpool

    spool = ShardSpool(run_dir / "shards", run_dir / "shards-staging", run.id, 0, attempt=0)
    parts = 0
    with store.reader() as con:
        for table, cls in bulk_tables().items():
            columns = ", ".join(f'"{n}"' for n in arrow_schema(cls).names)
            try:
                rows = con.sql(f'SELECT {columns} FROM "{table}" WHERE run_id = ?', params=[run.id])
            except duckdb.CatalogException:  # a collector's table this store never got
                continue
            for i, batch in enumerate(rows.to_arrow_reader(_BATCH_ROWS)):
                if spool.write_table(table, pa.Table.from_batches([batch]), part=f"single-{i:06d}") is not None:
                    parts += 1
    record = RankInfo(
        run.id, 0, local_rank=0, world_size=1, host=run.host or socket.gethostname(), pid=run.pid,
        status=run.status if run.status in ("ok", "failed", "interrupted") else "failed", exit_code=run.exit_code,
        started_at=run.started_at, ended_at=run.started_at + (run.duration_s or 0.0), artifacts_dir=str(run_dir),
    )  # fmt: skip
    spool.write_records(RankInfo, [record])
    return parts + 1


def publish(store: Store, run: Run, run_dir: Path, url: str) -> str | None:
    """Shards, outcome, then the uploader; returns why it could not, or None (never raises)."""
    from tpudiag.remote import begin, end
    from tpudiag.remote.location import redact

    try:
        if not (run_dir / "shards").is_dir():  # spawned ranks wrote their own shards: those are the job
            export_shards(store, run, run_dir)
        (folder(run_dir) / "events").mkdir(parents=True, exist_ok=True)
        end(run_dir, run)  # first: the uploader finds the outcome at once and finishes
        begin(url, run_dir, run.id, node=layout.node_key(run.host, run.pid))
    except Exception as err:
        return redact(f"the run was not uploaded to {url}: {type(err).__name__}: {err}")
    with contextlib.suppress(OSError):
        (folder(run_dir) / _ASKED).unlink()  # published once
    return None


def publish_if_asked(store: Store, run: Run, run_dir: Path) -> str | None:
    url = asked(run_dir)
    return None if url is None else publish(store, run, run_dir, url)


def main(argv: list[str]) -> int:
    """``python -m tpudiag.remote.single DB RUN_ID``: started by the detached store write once the run is stored
    (``deferred_store``), with the stored run in ``upload/stored-run.json``."""
    import sys
    import time

    store = Store(argv[0])
    run_dir = store.run_dir(argv[1])
    try:
        data = json.loads((folder(run_dir) / "stored-run.json").read_text())
        run = Run.from_record(data)
    except (OSError, ValueError, TypeError) as err:
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} run {argv[1]} not uploaded: {err}\n")
        return 1
    why = publish_if_asked(store, run, run_dir)
    if why:
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {why}\n")
    return 1 if why else 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
