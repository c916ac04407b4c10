"""Several launchers, one job: a multi-node torchrun (one ``tpudiag capture`` per node) lands in one run.

The job's run id is the same on every node without any talking between them:

- ``tpudiag capture --run-id ID ...`` when given (any launcher);
- else torchrun's ``--rdzv-id`` when the job spans nodes (``--nnodes`` other than 1): every node of a torchrun job
  must pass the same one.  A single-node job keeps a fresh run id (rendezvous ids are often reused there).

A reused id (a finished run of an earlier job already holds it) moves on to ``ID.2``, ``ID.3``...: each node takes
the first of these that is free or still ``running``, deciding in one store transaction, so the nodes of one job
agree (a node cannot finish before every node has joined torchrun's rendezvous, so the first node's run is still
``running`` when the last one looks).

Every node uses the same store, so on several machines the store (``--db``) must be on a shared filesystem.  Each
node keeps a marker in ``<run>/nodes/`` while its launcher runs; a node that finishes merges the shards written so
far, and the last node out merges every rank's shards and sets the run's final status and exit code (the worst of
the nodes': the first non-zero exit).  Until then the run stays ``running``, its record pointing at a live node.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tpudiag.errors import UsageError
from tpudiag.model import Run
from tpudiag.store import Store
from tpudiag.store.database import decode_run

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
MAX_REUSE = 100
_WORSE = {"ok": 0, "interrupted": 1, "failed": 2}


def clean_id(value: str) -> str:
    cleaned = _SAFE.sub("-", value.strip()).strip("-.")[:80]
    if not cleaned:
        raise UsageError(f"--run-id {value!r}: needs letters, digits, '.', '_' or '-'")
    return cleaned


def parse_launcher_args(launcher_args: Sequence[str]) -> Any:
    """torchrun's arguments parsed by torchrun's own parser (an ``argparse.Namespace``), or None."""
    loaded = "torch.distributed.run" in sys.modules
    try:
        from torch.distributed.run import get_args_parser

        args, _ = get_args_parser().parse_known_args(list(launcher_args))
    except (ImportError, SystemExit, Exception):  # not torchrun's arguments: torchrun itself will say so
        return None
    finally:
        if not loaded:  # runpy runs the launcher as __main__ next, and warns on stderr if it is already imported
            sys.modules.pop("torch.distributed.run", None)
    return args


def job_id(launcher_args: Sequence[str], explicit: str | None) -> str | None:
    """The id every node of the job derives the same way, or None (a fresh run id)."""
    if explicit:
        return clean_id(explicit)
    args = parse_launcher_args(launcher_args)
    if args is None:
        return None
    nnodes = str(getattr(args, "nnodes", "1"))
    rdzv = str(getattr(args, "rdzv_id", "none") or "none")
    if rdzv == "none" or nnodes in ("1", "1:1"):
        return None
    return clean_id(rdzv)


def candidates(job: str) -> list[str]:
    return [job] + [f"{job}.{n}" for n in range(2, MAX_REUSE + 1)]


def join_or_create(store: Store, job: str, fresh: Run) -> tuple[Run, bool]:
    """The job's run: the first id of ``candidates(job)`` that is free (``fresh`` stored under it) or still
    running (joined).  One transaction, so concurrent nodes agree.  (run, joined)."""
    with store.writer() as w:
        for rid in candidates(job):
            cur = w.execute("SELECT * FROM runs WHERE id = ?", [rid])
            cols = [d[0] for d in cur.description or []]
            row = cur.fetchone()
            if row is None:
                run = dataclasses.replace(fresh, id=rid, artifacts_dir=str(store.run_dir(rid).resolve()))
                store.put_run(run, con=w)
                return run, False
            existing = decode_run(dict(zip(cols, row, strict=True)))
            if existing["status"] == "running":
                return Run.from_record(existing), True
    raise UsageError(f"run ids {job} .. {job}.{MAX_REUSE} are all taken by finished runs: pass --run-id NEW")


@dataclasses.dataclass
class NodeMarker:
    """This node's presence in the run's ``nodes/`` folder while its launcher runs."""

    run_dir: Path
    host: str = dataclasses.field(default_factory=socket.gethostname)
    pid: int = dataclasses.field(default_factory=os.getpid)

    @property
    def folder(self) -> Path:
        return self.run_dir / "nodes"

    @property
    def path(self) -> Path:
        return self.folder / f"{self.host}-{self.pid}.running"

    def enter(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps({"host": self.host, "pid": self.pid}))

    def leave(self, status: str, exit_code: int | None, notes: Sequence[str]) -> list[dict[str, Any]]:
        """Record this node's outcome; the nodes still running (their markers' host and pid)."""
        done = self.path.with_suffix(".done")
        tmp = done.with_suffix(".tmp")
        tmp.write_text(json.dumps({"status": status, "exit_code": exit_code, "notes": list(notes)}))
        tmp.replace(done)
        self.path.unlink(missing_ok=True)
        return [_read(p) for p in sorted(self.folder.glob("*.running"))]

    def outcomes(self) -> list[dict[str, Any]]:
        return [_read(p) for p in sorted(self.folder.glob("*.done"))]


def _read(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def combine(run: Run, outcomes: Sequence[dict[str, Any]]) -> Run:
    """The job's status, exit code and notes from every node's outcome (the worst status, first non-zero exit)."""
    status = run.status
    exit_code = run.exit_code
    notes = list(run.notes)
    for o in outcomes:
        if _WORSE.get(str(o.get("status")), 0) > _WORSE.get(status, 0):
            status = str(o["status"])
        if not exit_code and o.get("exit_code"):
            exit_code = int(o["exit_code"])
        notes += [n for n in o.get("notes") or [] if n not in notes]
    return dataclasses.replace(run, status=status, exit_code=exit_code, notes=notes)
