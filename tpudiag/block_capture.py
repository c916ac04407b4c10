"""Capture a block of code in this process (the pytest plugin's capture; ``tpudiag capture`` runs whole scripts).

    with capture_block(Store(path), "test_model") as cap:
        model(x)
    cap.run_id  # stored, finished run

The collectors are the same as ``tpudiag capture``'s and the run lands in the store the same way (spool, then one
short write).  Collector failures become notes on the run, never exceptions in the caller's code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import tpudiag
from tpudiag import environment, internal_errors
from tpudiag.capture import new_run_id
from tpudiag.clock import SystemClock
from tpudiag.model import Run
from tpudiag.plugins import CaptureContext, Collector, load_collectors
from tpudiag.spool import Spool
from tpudiag.store import Store


@dataclass
class BlockCapture:
    store: Store
    run_id: str
    notes: list[str] = field(default_factory=list)
    finished: bool = False
    _stop: Any = None

    def stop(self) -> None:
        """Stop collecting and store the run (idempotent)."""
        if not self.finished and self._stop is not None:
            self._stop("ok", 0)


@contextlib.contextmanager
def capture_block(
    store: Store,
    name: str,
    collect: list[str] | None = None,
    options: dict[str, Any] | None = None,
    script: str | None = None,
) -> Iterator[BlockCapture]:
    clock = SystemClock()
    collectors = load_collectors(collect)
    run_id = new_run_id(clock)
    run_dir = store.run_dir(run_id).resolve()
    spool = Spool(run_dir / "spool")
    run = Run(
        id=run_id,
        name=name,
        status="running",
        started_at=clock.wall(),
        script=script or name,
        argv=[],
        cwd=os.getcwd(),
        host=environment.host(),
        pid=os.getpid(),
        python_version=environment.python_version(),
        tpudiag_version=tpudiag.__version__,
        env=environment.env_knobs(),
        collectors=[c.name for c in collectors],
        artifacts_dir=str(run_dir),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    errors = internal_errors.begin(run_dir)
    store.put_run(run)
    ctx = CaptureContext(run_id=run_id, run_dir=run_dir, spool=spool, options=dict(options or {}), clock=clock)
    active: list[Collector] = []
    for c in collectors:
        try:
            c.prepare(ctx)
            c.start(ctx)
            active.append(c)
        except Exception as err:  # a broken collector must not break the caller's code
            ctx.note(f"collector {c.name} failed to start: {err}")
    t0 = clock.monotonic()
    handle = BlockCapture(store, run_id, ctx.notes)

    def finish(status: str, exit_code: int) -> None:
        handle.finished = True
        duration = clock.monotonic() - t0
        for c in reversed(active):
            try:
                c.stop()
            except Exception as err:
                ctx.note(f"collector {c.name} failed while stopping: {err}")
        kind, device_name = environment.device()
        final = dataclasses.replace(
            run,
            status=status,
            exit_code=exit_code,
            duration_s=round(duration, 6),
            torch_version=environment.torch_version(),
            device_kind=kind,
            device_name=device_name,
            precision={**environment.precision(), **ctx.metadata.get("precision", {})},
            notes=([f"{internal_errors.NOTE_PREFIX} {line}"] if (line := errors.closing_line()) else [])
            + list(ctx.notes),
        )
        with store.writer() as w:
            store.finish_run(run_id, spool.directory, con=w)
            store.put_run(final, con=w)

    handle._stop = finish
    try:
        yield handle
    except BaseException:
        if not handle.finished:
            finish("failed", 1)
        raise
    if not handle.finished:
        finish("ok", 0)
    sys.stderr.flush()
