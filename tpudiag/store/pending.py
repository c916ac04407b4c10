"""Runs being stored in the background, and the readers that wait for them.

A capture that leaves its store write to a detached child (``tpudiag/deferred_store.py``) marks the run pending:
a file ``<runs dir>/.pending/<run id>``, locked (``flock``) by the child for as long as it works.  Every reader
settles pending runs first (``Store.reader``): it waits while a marker is locked, so no command reads a half-stored
run.  A marker nobody holds (the child died or never started) is finished by the reader itself with the
``finisher`` it was given: ``tpudiag.store_access.open_store`` hands ``deferred_store.finish`` to every store a
command or the dashboard opens.  A store opened without one waits for live children and leaves orphans to the next
command.  A run that could not be finished keeps its marker and files; it is tried once per process.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpudiag.errors import StoreLockedError

if TYPE_CHECKING:
    from tpudiag.store.database import Store

Finisher = Callable[["Store", str], Any]  # stores one pending run (its files are in the run's folder)
LOG_FILE = "store.log"
_WAIT_STEP_S = 0.05
_finishing: set[str] = set()  # runs this process is finishing: its own readers must not wait for them
_failed: set[str] = set()  # runs this process could not finish: tried once per process, not at every read


def pending_dir(store: Store) -> Path:
    return store.runs_dir / ".pending"


def is_pending(store: Store, run_id: str) -> bool:
    return (pending_dir(store) / run_id).exists()


@contextlib.contextmanager
def finishing(run_id: str) -> Iterator[None]:
    """While this process stores ``run_id``, its own readers do not wait for that run."""
    _finishing.add(run_id)
    try:
        yield
    finally:
        _finishing.discard(run_id)


def settle(store: Store, finisher: Finisher | None) -> None:
    """Wait for every run being stored in the background; finish any whose child is gone (with ``finisher``)."""
    try:
        names = sorted(os.listdir(pending_dir(store)))
    except (FileNotFoundError, NotADirectoryError):
        return
    for run_id in names:
        if run_id.startswith(".") or run_id in _finishing or run_id in _failed:
            continue
        _settle_one(store, run_id, finisher)


def _settle_one(store: Store, run_id: str, finisher: Finisher | None) -> None:
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
        if not _same_file(fd, marker) or finisher is None:
            return  # the child finished (and removed the marker) while we waited, or nobody here can finish it
        try:
            finisher(store, run_id)
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
