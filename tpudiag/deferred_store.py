"""A capture's store write, taken off the path the user waits on.

Once the script has run and the collectors have stopped, what is left (analysing the last trace chunk, loading the
spool into DuckDB, the run's final record) does not change the script's exit status, so ``tpudiag capture`` hands
it to a detached child process and exits at once:

- the final record goes to ``<run dir>/run.json``, then a marker ``<runs dir>/.pending/<run id>`` is created and
  locked (``flock``); the child inherits the locked descriptor, finishes the run, removes the marker and exits;
- every reader (``Store.reader``) settles pending runs first: it waits while a marker is locked, and finishes a run
  itself when its marker is unlocked (the child died or never started), so no command ever reads a half-stored run
  and no run is lost;
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
from pathlib import Path
from typing import TYPE_CHECKING

from tpudiag.atomic_file import atomic_file
from tpudiag.errors import StoreLockedError, TpudiagError
from tpudiag.model import Run

if TYPE_CHECKING:
    from tpudiag.store import Store

RUN_FILE = "run.json"
LOG_FILE = "store.log"
_WAIT_STEP_S = 0.05
_finishing: set[str] = set()  # runs this process is finishing: its own readers must not wait for them
_failed: set[str] = set()  # runs this process could not finish: tried once per process, not at every read


def pending_dir(store: Store) -> Path:
    return store.runs_dir / ".pending"


def write_run_file(run_dir: Path, run: Run) -> None:
    """The run's final record, written atomically (a reader sees all of it or nothing)."""
    with atomic_file(run_dir / RUN_FILE, "w") as fh:
        json.dump(dataclasses.asdict(run), fh)


def read_run_file(run_dir: Path) -> Run:
    data = json.loads((run_dir / RUN_FILE).read_text())
    names = {f.name for f in dataclasses.fields(Run)}
    return Run(**{k: v for k, v in data.items() if k in names})


def hand_off(store: Store, run: Run, run_dir: Path) -> bool:
    """Leave ``run`` to a detached child that stores it; False when no child could start (store it yourself)."""
    write_run_file(run_dir, run)
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
    """Store a handed-off run: its collectors' deferred work, then spool and final record in one transaction."""
    from tpudiag.plugins import CaptureContext, deferred_finishers
    from tpudiag.spool import Spool

    run_dir = store.run_dir(run_id)
    run = read_run_file(run_dir)
    spool = Spool(run_dir / "spool")
    ctx = CaptureContext(run_id=run_id, run_dir=run_dir, spool=spool)
    _finishing.add(run_id)
    try:
        for name, work in deferred_finishers(run.collectors):
            try:
                work(ctx)
            except Exception as err:
                ctx.note(f"collector {name} failed while finishing: {err}")
        run = dataclasses.replace(run, notes=list(run.notes) + [n for n in ctx.notes if n not in run.notes])
        store.store_finished(run, spool.directory)
    finally:
        _finishing.discard(run_id)
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


def is_pending(store: Store, run_id: str) -> bool:
    return (pending_dir(store) / run_id).exists()


def settle(store: Store) -> None:
    """Wait for every run being stored in the background; finish any whose child is gone."""
    try:
        names = sorted(os.listdir(pending_dir(store)))
    except (FileNotFoundError, NotADirectoryError):
        return
    for run_id in names:
        if run_id.startswith(".") or run_id in _finishing or run_id in _failed:
            continue
        _settle_one(store, run_id)


def _settle_one(store: Store, run_id: str) -> None:
    marker = pending_dir(store) / run_id
    try:
        fd = os.open(marker, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        deadline = time.monotonic() + store.lock_timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise StoreLockedError(
                        f"run {run_id} was still being stored after {store.lock_timeout_s:g} s "
                        f"(see {store.run_dir(run_id) / LOG_FILE}; set TPUDIAG_LOCK_TIMEOUT to wait longer)"
                    ) from None
                time.sleep(_WAIT_STEP_S)
        if not _same_file(fd, marker):
            return  # the child finished (and removed the marker) while we waited
        try:
            finish(store, run_id)
        except Exception as err:  # whatever it is, this reader goes on; the run's files stay for the next one
            _failed.add(run_id)
            sys.stderr.write(f"tpudiag: warning: run {run_id} could not be stored yet: {err}\n")
            return
        marker.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def main(argv: list[str]) -> int:
    """The child: ``python -m tpudiag.deferred_store DB RUN_ID LOCK_FD`` (the locked marker's descriptor)."""
    from tpudiag.store import Store

    db, run_id, fd = argv[0], argv[1], int(argv[2])
    store = Store(db)
    marker = pending_dir(store) / run_id
    try:
        finish(store, run_id)
    except Exception as err:
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} run {run_id} not stored: {err!r}\n")
        raise
    marker.unlink(missing_ok=True)
    os.close(fd)
    with contextlib.suppress(TpudiagError):
        store.recover_stale_runs()  # what a capture used to do before its script: off every user's path now
    log = store.run_dir(run_id) / LOG_FILE
    with contextlib.suppress(OSError):
        if log.stat().st_size == 0:
            log.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
