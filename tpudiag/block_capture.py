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
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from tpudiag import environment, internal_errors
from tpudiag.clock import SystemClock
from tpudiag.plugins import CaptureContext, load_collectors
from tpudiag.run_setup import RunStart, begin_run, start_collectors
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
    run, run_dir = begin_run(store, clock, RunStart(name, script or name), collectors)
    run_id = run.id
    spool = Spool(run_dir / "spool")
    errors = internal_errors.begin(run_dir)
    ctx = CaptureContext(run_id=run_id, run_dir=run_dir, spool=spool, options=dict(options or {}), clock=clock)
    active = start_collectors(collectors, ctx)
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
        store.store_finished(final, spool.directory)

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
