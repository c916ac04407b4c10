"""The manual trigger: ``tpudiag trigger RUN [--steps N] [--numerics all]`` from another shell, or
``tpudiag.trigger()`` in Python, opens a window in a running job.

A request is a small JSON file in the run folder's ``triggers/`` (written atomically, never removed by the job), so
every process of the run (each rank of a distributed job, each node on its own disk) sees it, through no signal the
script might use.  Each process polls the folder's modification time about twice a second from its step hook
(one ``stat``), reads only files it has not seen, and opens the window at its next step boundary.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from tpudiag.atomic_file import atomic_file
from tpudiag.errors import UsageError

FOLDER = "triggers"
POLL_S = 0.5


def write_request(run_dir: Path, steps: int | None = None, numerics: str | None = None) -> Path:
    """A trigger request in ``run_dir``; its path."""
    folder = run_dir / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.time_ns()}-{secrets.token_hex(3)}.json"
    with atomic_file(path, "w") as fh:
        json.dump({"steps": steps, "numerics": numerics, "pid": os.getpid(), "at": time.time()}, fh)
    return path


class Poller:
    """Polls the trigger folders of one process's run (its own folder, and a distributed job's top folder)."""

    def __init__(self, folders: list[Path], clock_s: float) -> None:
        self._folders = folders
        self._mtimes: dict[Path, int] = {}
        self._seen: set[str] = set()
        self.next_s = clock_s + POLL_S

    def due(self, now_s: float) -> bool:
        return now_s >= self.next_s

    def poll(self, now_s: float) -> list[dict[str, Any]]:
        """New requests since the last poll (cheap when nothing changed: one stat per folder)."""
        self.next_s = now_s + POLL_S
        found: list[dict[str, Any]] = []
        for folder in self._folders:
            try:
                mtime = os.stat(folder).st_mtime_ns
            except OSError:
                continue
            if self._mtimes.get(folder) == mtime:
                continue
            self._mtimes[folder] = mtime
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            for name in names:
                if not name.endswith(".json") or name in self._seen:
                    continue
                self._seen.add(name)
                try:
                    found.append(json.loads((folder / name).read_text()))
                except (OSError, ValueError):
                    continue
        return found


def trigger_folders(run_dir: Path) -> list[Path]:
    """Where this process's run takes requests: its folder, and the job's folder for a rank worker
    (``<run>/workers/<tag>``)."""
    folders = [run_dir / FOLDER]
    if run_dir.parent.name == "workers":
        folders.append(run_dir.parent.parent / FOLDER)
    return folders


def run_folder(db: Path, ref: str) -> Path:
    """The folder of run ``ref``: a run folder's path, a run id (its folder exists from the run's start), or a run
    name (looked up in the store)."""
    path = Path(ref)
    if (path.is_dir() and (path / "spool").exists()) or (path / FOLDER).is_dir():
        return path
    from tpudiag.store import Store

    store = Store(db)
    candidate = store.run_dir(ref)
    if candidate.is_dir():
        return candidate
    if not store.exists():
        raise UsageError(f"no run {ref!r}: no run folder and no store at {db}")
    from tpudiag.store import queries

    run = queries.resolve_run(store, ref)
    folder = Path(run.get("artifacts_dir") or store.run_dir(str(run["id"])))
    if run.get("status") != "running":
        raise UsageError(f"run {run['id']} is not running (status {run.get('status')}): nothing to trigger")
    return folder


def trigger(steps: int | None = None, numerics: str | None = None, run: str | Path | None = None) -> bool:
    """Open a trace window (numerics fully on for it within ``--budget`` when ``numerics="all"``).

    Inside a capture (``tpudiag capture`` or a capture block) the window opens at this process's next step
    boundary.  With ``run`` (a run id, name or folder) the request goes to that running job, whatever process it
    is in.  True when the request was taken.
    """
    if steps is not None and steps < 1:
        raise UsageError("trigger: --steps must be at least 1")
    if numerics not in (None, "all", "sample"):
        raise UsageError(f"trigger: --numerics {numerics!r}: expected all or sample")
    if run is None:
        from tpudiag.longrun import control

        return control.request("manual", steps=steps, numerics=numerics == "all", detail="tpudiag.trigger()")
    from tpudiag.store import resolve_db_path

    folder = run_folder(resolve_db_path(None), str(run))
    write_request(folder, steps, numerics)
    return True
