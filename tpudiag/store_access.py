"""``open_store``: the one way commands, the dashboard and the Python API open a store.

A ``Store`` waits for runs being stored in the background before it reads (``store/pending.py``); the store
returned here can also finish a run whose detached child died (``deferred_store.finish``: the collectors' deferred
jobs, then the spool).  The store package itself never imports the capture side: the finisher is handed to it here.
"""

from __future__ import annotations

import os
from pathlib import Path

from tpudiag import deferred_store
from tpudiag.store import Store, resolve_db_path


def open_store(db: str | os.PathLike[str] | None = None, lock_timeout_s: float | None = None) -> Store:
    """The store at ``db`` (None: ``TPUDIAG_DB`` or ./tpudiag.duckdb)."""
    path = Path(db) if db is not None else resolve_db_path(None)
    return Store(path, lock_timeout_s=lock_timeout_s, finisher=deferred_store.finish)
