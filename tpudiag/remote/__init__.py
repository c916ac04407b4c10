"""Runs in object storage: each node uploads its run folder's final files; readers gather them or read in place.

The entry points a capture driver calls when ``--remote URL`` is given (everything else lives in this package):

- ``begin(url, run_dir, run_id)`` before the job starts: checks the URL, starts the uploader process;
- ``files_ready(run_dir, paths)`` whenever a set of files is final (a finished trace window);
- ``end(run_dir, run)`` once the job's outcome is known: the uploader sends the rest and the completion marker.

None of them waits for the bucket or raises into the job (``begin`` raises UsageError for a bad URL only, before
the job starts).  Readers: ``tpudiag gather`` (``gather.py``), ``tpudiag report --remote`` (``reader.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tpudiag.atomic_file import atomic_file
from tpudiag.model import Run
from tpudiag.processes import make_background
from tpudiag.remote import layout
from tpudiag.remote.location import parse, redact
from tpudiag.remote.uploader import UploadConfig, folder

__all__ = ["JobUpload", "begin", "end", "files_ready", "pending", "redact"]


class JobUpload:
    """``--remote URL`` for the distributed launcher (``tpudiag.distributed.launch.Upload``).  Made before the job
    starts, so a bad URL or a missing client extra is a usage error then, not a silent failure later."""

    def __init__(self, url: str) -> None:
        self.remote = parse(url)
        self.remote.filesystem()

    def begin(self, run_dir: Path, run_id: str) -> str | None:
        try:
            begin(self.remote.url, run_dir, run_id)
        except Exception as err:  # the job runs anyway; its files stay local (tpudiag upload RUN retries)
            return redact(f"the uploader did not start: {type(err).__name__}: {err}")
        return None

    def end(self, run_dir: Path, run: Run) -> None:
        end(run_dir, run)


def begin(url: str, run_dir: Path, run_id: str, node: str | None = None) -> UploadConfig:
    """Start uploading ``run_dir`` as node ``node`` (default ``<host>-<pid>``) of run ``run_id`` to ``url``."""
    remote = parse(url)
    remote.filesystem()  # a missing client extra is a usage error now, not a silent failure later
    config = UploadConfig(
        url=remote.url,
        run_id=run_id,
        node=node or layout.node_key(),
        host=socket.gethostname(),
        launcher_pid=os.getpid(),
    )
    up = folder(run_dir)
    (up / "events").mkdir(parents=True, exist_ok=True)
    config.save(run_dir)
    with open(up / "uploader.out", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tpudiag.remote.uploader", str(run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            start_new_session=True,  # a signal to the job's process group does not reach it
            close_fds=True,
        )
    make_background(proc.pid, idle=False)  # a share of a busy core, not half of it; full speed on a free one
    (up / "uploader.pid").write_text(str(proc.pid))
    return config


def files_ready(run_dir: Path, paths: Iterable[Path] = ()) -> None:
    """A finished set of files (empty: just look for new shards now)."""
    with contextlib.suppress(OSError):
        events = folder(run_dir) / "events"
        name = f"{time.time_ns()}-{os.getpid()}.files.json"
        with atomic_file(events / name, "w") as fh:
            json.dump({"files": [str(p) for p in paths]}, fh)


def end(run_dir: Path, run: Run) -> None:
    """The node's outcome: the uploader sends what is left, then the completion marker."""
    record = dataclasses.asdict(run)
    record["env"] = {}  # knobs only ever, but the bucket gets nothing from the environment
    outcome = {"status": run.status, "exit_code": run.exit_code, "notes": list(run.notes), "run": record}
    with contextlib.suppress(OSError), atomic_file(folder(run_dir) / "events" / "end.json", "w") as fh:
        json.dump(outcome, fh, default=str)


def pending(run_dir: Path) -> dict[str, Any] | None:
    """What this run folder could not upload (``upload/pending.json``), or None."""
    path = folder(run_dir) / "pending.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("files") else None


def wait(run_dir: Path, timeout_s: float) -> str | None:
    """The uploader's final state (``done``, ``pending``, ``crashed``) once it has one, or None after the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            state = json.loads((folder(run_dir) / "status.json").read_text()).get("state")
            if state:
                return str(state)
        time.sleep(0.2)
    return None
