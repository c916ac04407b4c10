"""A running capture's spool loaded when someone reads the store, not only on the feeder's clock (issue 21).

The feeder child (``store/feeder.py``) loads a running capture's spool into the store on a slow clock of its own
(``cadence.unwatched_interval``: every load opens the store, inserts and checkpoints, ~0.1 s of CPU whatever it
carries, and on a machine whose cores are all busy that CPU is the training loop's).  A reader of the store (the
dashboard's live pages, ``report``, ``check``: ``Store.reader``) asks for a load first, so it reads the job as it
was at most ``FRESH_S`` ago, not as of the feeder's last load.  The files, in ``<runs dir>/.feeding/`` (one small
folder to list, however many runs the store holds):

- ``<run id>``: there while the run's feeder runs (its parent makes it once the feeder started, and removes it
  after the feeder left);
- ``<run id>.want``: a reader's request, made when the feeder has not loaded in the last ``FRESH_S`` seconds
  (``<run id>.loaded``'s time); the reader waits until the feeder has removed it, up to ``WAIT_S``;
- ``<run id>.loaded``: touched by the feeder after each load, which also removes the request (it looks for one
  every second, ``feeder.WANT_CHECK_S``).

A request nobody serves (the feeder is gone, or starved of CPU) costs a reader ``WAIT_S`` once: a request older than
that is taken as unserved, and later readers do not wait for it.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

FOLDER = ".feeding"
WANT = ".want"
LOADED = ".loaded"
# A load this recent is fresh enough: a page's many queries ask once, and a dashboard left open on a running job
# (its timeline refreshes every 5 s) costs a load every 10 s, the feeder's cadence at a run's start, not one a
# refresh; the pulse is spooled every 5 s and the other collectors' rows every 10-30 s anyway.
FRESH_S = 10.0
WAIT_S = 2.0  # the longest a reader waits for a load
_POLL_S = 0.02


def folder(runs_dir: Path) -> Path:
    return runs_dir / FOLDER


def _age(path: str, now: float) -> float | None:
    try:
        return now - os.stat(path).st_mtime
    except OSError:
        return None


def ask_for_fresh(runs_dir: Path, wait_s: float = WAIT_S) -> int:
    """Ask the feeders of the store's running captures for a load and wait for them (up to ``wait_s``); how many
    were asked.  One directory listing where nothing runs."""
    base = os.fspath(folder(runs_dir))
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    now = time.time()
    asked: list[tuple[str, str]] = []
    for run_id in names:
        if run_id.endswith((WANT, LOADED)):  # a request or a load mark
            continue
        marker = os.path.join(base, run_id)
        loaded = _age(marker + LOADED, now)
        if loaded is not None and loaded < FRESH_S:
            continue
        want = marker + WANT
        pending = _age(want, now)
        if pending is not None and pending > WAIT_S:
            continue  # asked before and never served: the feeder is gone or starved
        if pending is None:
            try:
                Path(want).touch()
            except OSError:
                continue  # a folder this reader may not write: it reads what is loaded
        asked.append((marker, want))
    count = len(asked)
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        asked = [(m, w) for m, w in asked if os.path.exists(w) and os.path.exists(m)]
    return count


def start(runs_dir: Path, run_id: str) -> None:
    """(The feeder's parent, once it started) the run is fed: readers may ask (where the mark cannot be made they
    read what the feeder's own clock loaded)."""
    with contextlib.suppress(OSError):
        folder(runs_dir).mkdir(parents=True, exist_ok=True)
        (folder(runs_dir) / run_id).touch()


def want_path(runs_dir: Path, run_id: str) -> str:
    """(The feeder) the request file it looks for at each poll."""
    return os.fspath(folder(runs_dir) / (run_id + WANT))


def mark_loaded(runs_dir: Path, run_id: str) -> None:
    """(The feeder, after each load) when it loaded, and any request it served gone."""
    base = folder(runs_dir) / run_id
    with contextlib.suppress(OSError):
        Path(os.fspath(base) + LOADED).touch()
    with contextlib.suppress(OSError):
        os.unlink(os.fspath(base) + WANT)


def stop(runs_dir: Path, run_id: str) -> None:
    """(The feeder's parent after it left; the feeder itself when its parent is gone; ``recover_stale_runs`` for a
    run whose processes were all killed) the run is no longer fed."""
    base = os.fspath(folder(runs_dir) / run_id)
    for path in (base, base + WANT, base + LOADED):
        with contextlib.suppress(OSError):
            os.unlink(path)
