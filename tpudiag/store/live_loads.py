"""A running capture's spool loaded when someone reads the store, not only on the feeder's clock (issue 21).

The feeder child (``store/feeder.py``) loads a running capture's spool into the store on a slow clock of its own
(``cadence.unwatched_interval``: every load opens the store, inserts and checkpoints, ~0.1 s of CPU whatever it
carries, and on a machine whose cores are all busy that CPU is the training loop's).  A reader of the store (the
dashboard's live pages, ``report``, ``check``: ``Store.reader``) asks for a load first, so it reads the job as it
is now, not as it was at the last load:

- the reader touches ``<run dir>/feeder.want`` for each running capture of the store (its folder holds the
  feeder's ``feeder.json``) whose feeder has not loaded in the last ``FRESH_S`` seconds (``feeder.loaded``'s time),
  and waits until the feeder has removed it, up to ``WAIT_S``;
- the feeder looks for the file at each of its polls (every 0.2 s), loads, marks ``feeder.loaded`` and removes it.

A request nobody serves (the feeder is gone, or starved of CPU) costs a reader ``WAIT_S`` once: a request file
older than that is taken as unserved, and later readers do not wait for it.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

RUN_FILE = "feeder.json"  # the running capture's record, there while its feeder runs (store/feeder.py)
WANT_FILE = "feeder.want"
LOADED_FILE = "feeder.loaded"
FRESH_S = 2.0  # a load this recent is fresh enough: a page's many queries ask once
WAIT_S = 2.0  # the longest a reader waits for a load
_POLL_S = 0.02


def _age(path: Path, now: float) -> float | None:
    try:
        return now - path.stat().st_mtime
    except OSError:
        return None


def running_run_dirs(runs_dir: Path) -> list[Path]:
    """The folders of the store's captures whose feeder is running."""
    try:
        names = os.listdir(runs_dir)
    except OSError:
        return []
    return [runs_dir / n for n in names if not n.startswith(".") and (runs_dir / n / RUN_FILE).is_file()]


def ask_for_fresh(runs_dir: Path, wait_s: float = WAIT_S) -> int:
    """Ask the feeders of the store's running captures for a load and wait for them (up to ``wait_s``); how many
    were asked.  Costs a directory listing where nothing runs."""
    now = time.time()
    asked: list[Path] = []
    for run_dir in running_run_dirs(runs_dir):
        loaded = _age(run_dir / LOADED_FILE, now)
        if loaded is not None and loaded < FRESH_S:
            continue
        want = run_dir / WANT_FILE
        pending = _age(want, now)
        if pending is not None and pending > WAIT_S:
            continue  # asked before and never served: the feeder is gone or starved
        if pending is None:
            try:
                want.touch()
            except OSError:
                continue  # a folder this reader may not write: it reads what is loaded
        asked.append(want)
    count = len(asked)
    deadline = time.monotonic() + wait_s
    while asked and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        asked = [w for w in asked if w.exists() and (w.parent / RUN_FILE).exists()]
    return count


def mark_loaded(run_dir: Path) -> None:
    """(The feeder, after each load) when it loaded, and any request it served gone."""
    with contextlib.suppress(OSError):
        (run_dir / LOADED_FILE).touch()
    with contextlib.suppress(OSError):
        (run_dir / WANT_FILE).unlink()


def clear(run_dir: Path) -> None:
    """(The feeder's parent, at its stop) the request and load marks removed with the feeder's record."""
    for name in (WANT_FILE, LOADED_FILE):
        with contextlib.suppress(OSError):
            (run_dir / name).unlink()
