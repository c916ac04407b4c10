"""Every worker process a single captured script starts, reached: one run for the whole job.

A plain ``tpudiag capture script.py`` (or ``-m module``, or a console script such as ``accelerate launch``) does
not know before it runs whether the script is a launcher.  While it runs:

- ``torch.multiprocessing.spawn`` workers become ranks (``tpudiag.distributed.spawn``);
- workers of torchrun's elastic agent become ranks, whichever launcher runs the agent: an agent in this process
  (``accelerate launch``, ``elastic_launch``...) starts them through ``subprocess``, where ``children.ChildWatch``
  swaps their interpreter for the run's worker wrapper; an agent in a child process (``torchrun`` started by the
  script) reads ``PYTHON_EXEC``, set to the same wrapper as for ``tpudiag capture torchrun``;
- any other Python process the script starts is counted, and the run's notes say how to capture it.

When the script ends, the ranks' shards are merged into the run.  Elastic workers' data goes into the run's own
tables (the launcher process is bookkeeping, not a rank); spawned workers' goes into the ``dist_*`` tables, the
parent's own rows kept as rank -1 (it is the program).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Any

from tpudiag.distributed import children, spawn
from tpudiag.model import Run
from tpudiag.plugins import CaptureContext
from tpudiag.session import Finished
from tpudiag.store import Store

NO_OPS_NOTE = "numerics: no aten ops were seen"  # the numerics collector's note when its own process ran none


class WorkerReach:
    def __init__(
        self, run_id: str, run_dir: Path, collect: list[str] | None, options: dict[str, Any], flush_s: float
    ) -> None:
        self.run_id, self.run_dir, self.collect, self.options, self.flush_s = (
            run_id, run_dir, collect, dict(options), flush_s
        )  # fmt: skip
        self.spawn: spawn.SpawnPatch | None = None
        self.watch: children.ChildWatch | None = None
        self._env = contextlib.ExitStack()
        self._ctx: CaptureContext | None = None

    def install(self, ctx: CaptureContext) -> None:
        self._ctx = ctx
        self.spawn = spawn.install(self.run_id, str(self.run_dir), self.collect, self.options, self.flush_s, ctx.note)
        try:
            from tpudiag.distributed import wrapper as worker_wrapper
            from tpudiag.distributed.session import WorkerConfig

            config = WorkerConfig(self.run_id, str(self.run_dir), self.collect, dict(self.options), self.flush_s)
            wrapper = worker_wrapper.write_wrapper(self.run_dir, os.environ.get("PYTHON_EXEC") or sys.executable)
            self._env.enter_context(worker_wrapper.worker_environment(config, wrapper))
        except Exception as err:  # workers will not be ranks; the script runs as before
            ctx.note(f"elastic-agent workers will not be captured ({err})")
            wrapper = None
        self.watch = children.ChildWatch(wrapper)
        self.watch.install()

    def remove(self) -> None:
        """After the script: the wrappers and the environment put back; the missed processes noted."""
        if self.spawn is not None:
            self.spawn.remove()
        if self.watch is not None:
            self.watch.remove()
            missed = self.watch.note()
            if missed and self._ctx is not None:
                self._ctx.note(missed)
        with contextlib.suppress(Exception):
            self._env.close()

    @property
    def elastic(self) -> bool:
        """Workers of an elastic agent ran as ranks (their session folders exist)."""
        return (self.run_dir / "workers").is_dir() and not (self.spawn is not None and self.spawn.used)

    @property
    def used(self) -> bool:
        """Some worker became a rank: the run is merged here, after the script."""
        return (self.spawn is not None and self.spawn.used) or (self.run_dir / "workers").is_dir()

    def settle(self, finished: Finished) -> Finished:
        """After the collectors stopped: drop the numerics collector's "no aten ops" question from the run's notes
        (and the ones printed) when the script's torch work ran in other processes (ranks, or missed ones)."""
        missed = self.watch is not None and bool(self.watch.missed)
        if not (missed or self.elastic):
            return finished
        if self._ctx is not None:
            self._ctx.notes[:] = [n for n in self._ctx.notes if not n.startswith(NO_OPS_NOTE)]
        notes = [n for n in finished.run.notes if not n.startswith(NO_OPS_NOTE)]
        return dataclasses.replace(finished, run=dataclasses.replace(finished.run, notes=notes))

    def merge(self, store: Store, run: Run) -> Run:
        """The ranks' shards into the stored run (unchanged when no worker became a rank)."""
        if self.spawn is not None and self.spawn.used:
            return spawn.merge_ranks(store, run, self.run_dir)
        if not self.elastic:
            return run
        from tpudiag.distributed import merge

        run = dataclasses.replace(run, notes=[n for n in run.notes if not n.startswith(NO_OPS_NOTE)])
        return merge.store_merged(store, run, lambda w: merge.finish(store, run, self.run_dir, con=w))


def install(
    run_id: str,
    run_dir: Path,
    collect: list[str] | None,
    options: dict[str, Any],
    flush_s: float,
    ctx: CaptureContext,
) -> WorkerReach | None:
    """Reach the script's workers while it runs; never raises (None: nothing installed)."""
    try:
        reach = WorkerReach(run_id, run_dir, collect, options, flush_s)
        reach.install(ctx)
    except Exception as err:
        ctx.note(f"worker processes will not be captured ({err})")
        return None
    return reach
