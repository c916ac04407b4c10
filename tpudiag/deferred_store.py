"""A capture's store write, taken off the path the user waits on.

Once the script has run and the collectors have stopped, what is left (analysing the last trace chunk, loading the
spool into DuckDB, the run's final record) does not change the script's exit status, so ``tpudiag capture`` hands
it to a detached child process and exits at once:

- the final record goes to ``<run dir>/run.json``, then a marker ``<runs dir>/.pending/<run id>`` is created and
  locked (``flock``); the child inherits the locked descriptor, finishes the run, removes the marker and exits;
- ``run.json`` holds the final record and the collectors' deferred jobs (``plugins.DeferredJob``: a factory spec
  and JSON arguments), which the child runs before it loads the spool;
- every reader (``Store.reader``) settles pending runs first (``store/pending.py``): it waits while a marker is
  locked, and finishes a run itself (``finish``, handed to every store by ``store_access.open_store``) when its
  marker is unlocked (the child died or never started), so no command ever reads a half-stored run and no run is
  lost;
- a run whose child failed keeps its marker and its files; the next reader tries again and says why it could not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tpudiag.atomic_file import atomic_file
from tpudiag.errors import TpudiagError
from tpudiag.model import Run
from tpudiag.plugins import CaptureContext, DeferredJob, run_job
from tpudiag.spool import Spool
from tpudiag.store import Store
from tpudiag.store.pending import LOG_FILE, finishing, is_pending, pending_dir

RUN_FILE = "run.json"
__all__ = ["LOG_FILE", "RUN_FILE", "finish", "hand_off", "is_pending", "pending_dir", "read_run_file"]


def write_run_file(run_dir: Path, run: Run, jobs: Sequence[DeferredJob] = ()) -> None:
    """The run's final record and deferred jobs, written atomically (a reader sees all of it or nothing)."""
    with atomic_file(run_dir / RUN_FILE, "w") as fh:
        json.dump({"run": dataclasses.asdict(run), "jobs": [j.to_json() for j in jobs]}, fh)


def read_run_file(run_dir: Path) -> tuple[Run, list[DeferredJob]]:
    data = json.loads((run_dir / RUN_FILE).read_text())
    run = Run.from_record(data["run"])
    return run, [DeferredJob.from_json(j) for j in data.get("jobs") or []]


def hand_off(store: Store, run: Run, jobs: Sequence[DeferredJob], run_dir: Path) -> bool:
    """Leave ``run`` to a detached child that stores it; False when no child could start (store it yourself)."""
    write_run_file(run_dir, run, jobs)
    folder = pending_dir(store)
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / run.id
    fd = os.open(marker, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # at once: nobody else has seen this marker yet
        _start_child(store.path.resolve(), run.id, fd, run_dir)
    except OSError:
        os.close(fd)
        marker.unlink(missing_ok=True)
        return False
    os.close(fd)  # the child's copy keeps the lock
    return True


def _start_child(db: Path, run_id: str, fd: int, run_dir: Path) -> None:
    with open(run_dir / LOG_FILE, "ab") as log:
        subprocess.Popen(
            [sys.executable, "-m", "tpudiag.deferred_store", str(db), run_id, str(fd)],
            pass_fds=(fd,),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,  # the user's Ctrl-C after the script ended does not reach it
            cwd=run_dir,  # not the user's folder: a module of theirs cannot shadow one tpudiag imports
        )


def finish(store: Store, run_id: str) -> Run:
    """Store a handed-off run: its collectors' deferred jobs, then spool and final record in one transaction."""
    run_dir = store.run_dir(run_id)
    run, jobs = read_run_file(run_dir)
    spool = Spool(run_dir / "spool")
    ctx = CaptureContext(run_id=run_id, run_dir=run_dir, spool=spool)
    with finishing(run_id):
        for job in jobs:
            try:
                run_job(job, ctx)
            except Exception as err:
                ctx.note(f"collector {job.collector} failed while finishing: {err}")
        run = dataclasses.replace(run, notes=list(run.notes) + [n for n in ctx.notes if n not in run.notes])
        store.store_finished(run, spool.directory)
    with contextlib.suppress(OSError):
        remove_empty_tree(spool.directory)
    with contextlib.suppress(OSError):
        (run_dir / RUN_FILE).unlink()
    return run


def remove_empty_tree(folder: Path) -> None:
    if not folder.is_dir():
        return
    for sub in folder.iterdir():
        if sub.is_dir():
            remove_empty_tree(sub)
    folder.rmdir()


def _publish_if_asked(store: Store, run: Run) -> None:
    """``capture --remote`` of one process: hand the stored run to ``python -m tpudiag.remote.single`` (a process
    of its own: the remote package sits above this module and imports the store side)."""
    up = store.run_dir(run.id) / "upload"
    if not (up / "single.json").is_file():
        return
    try:
        with atomic_file(up / "stored-run.json", "w") as fh:
            json.dump(dataclasses.asdict(run), fh, default=str)
        subprocess.Popen(
            [sys.executable, "-m", "tpudiag.remote.single", str(store.path), run.id],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=sys.stderr,  # this child's log
            start_new_session=True,
            close_fds=True,
        )
    except OSError as err:
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} run {run.id} not uploaded: {err}\n")


def main(argv: list[str]) -> int:
    """The child: ``python -m tpudiag.deferred_store DB RUN_ID LOCK_FD`` (the locked marker's descriptor)."""
    db, run_id, fd = argv[0], argv[1], int(argv[2])
    store = Store(db, finisher=finish)
    marker = pending_dir(store) / run_id
    try:
        run = finish(store, run_id)
    except Exception as err:
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} run {run_id} not stored: {err!r}\n")
        raise
    marker.unlink(missing_ok=True)
    os.close(fd)
    _publish_if_asked(store, run)
    with contextlib.suppress(TpudiagError):
        store.recover_stale_runs()  # what a capture used to do before its script: off every user's path now
    log = store.run_dir(run_id) / LOG_FILE
    with contextlib.suppress(OSError):
        if log.stat().st_size == 0:
            log.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
