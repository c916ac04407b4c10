"""What every way of capturing does first: a new run's record (status ``running``) with its folder, then its
collectors prepared and started.  Used by the capture session (``tpudiag.session``) and its drivers."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tpudiag import environment
from tpudiag.clock import Clock
from tpudiag.model import Run
from tpudiag.plugins import CaptureContext, Collector
from tpudiag.store import Store
from tpudiag.version import __version__


def new_run_id(clock: Clock) -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime(clock.wall())) + "-" + secrets.token_hex(3)


@dataclass(frozen=True)
class RunStart:
    """What a run is, before it runs: ``name``, what ran (``script``, ``argv``) and where its code lives
    (``code_path``: the git commit of that path is recorded; None records none)."""

    name: str
    script: str
    argv: Sequence[str] = ()
    code_path: Path | None = None


def prepare_run(store: Store, clock: Clock, start: RunStart, collectors: Sequence[Collector]) -> tuple[Run, Path]:
    """A new run's record and its folder, created; the record is not stored yet (the caller registers it)."""
    run = new_run(store, clock, start, collectors)
    run_dir = Path(run.artifacts_dir or store.run_dir(run.id))
    run_dir.mkdir(parents=True, exist_ok=True)
    return run, run_dir


def new_run(store: Store, clock: Clock, start: RunStart, collectors: Sequence[Collector]) -> Run:
    """A new run's record (status ``running``, a fresh id), not stored yet."""
    run_id = new_run_id(clock)
    run_dir = store.run_dir(run_id).resolve()
    return Run(
        id=run_id,
        name=start.name,
        status="running",
        started_at=clock.wall(),
        script=start.script,
        argv=list(start.argv),
        cwd=os.getcwd(),
        host=environment.host(),
        pid=os.getpid(),
        python_version=environment.python_version(),
        tpudiag_version=__version__,
        env=environment.env_knobs(),
        git_commit=environment.git_commit(start.code_path.resolve()) if start.code_path else None,
        collectors=[c.name for c in collectors],
        artifacts_dir=str(run_dir),
    )


def start_collectors(
    collectors: Sequence[Collector], ctx: CaptureContext, note: Callable[[str], None] | None = None
) -> list[Collector]:
    """Prepare every collector, then start them; the ones that started.  A collector that fails is a note on the
    run (``ctx.note`` unless ``note`` is given), never an error: it must not break the user's code."""
    note = note or ctx.note
    for c in collectors:
        try:
            c.prepare(ctx)
        except Exception as err:
            note(f"collector {c.name} failed to prepare: {err}")
    active: list[Collector] = []
    for c in collectors:
        try:
            c.start(ctx)
            active.append(c)
        except Exception as err:
            note(f"collector {c.name} failed to start: {err}")
    return active
