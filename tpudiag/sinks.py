"""Where a finished run goes, for captures that own a store: now, or later in a detached child.

- ``StoreNow``: registers the run at its first flush (``register_at="flush"``: a short script never loads DuckDB
  before its code; the store write after it registers it) or at once (``"begin"``), has the spooled parts loaded
  while the code runs (by a child process, ``store/feeder.py``, else at every flush), and stores the finished run
  in one transaction before returning (``tpudiag capture --wait``, the Python API and notebooks);
- ``StoreLater``: the same while the code runs; the finished run goes to ``run.json`` with the collectors'
  deferred jobs and a detached child stores it (``tpudiag/deferred_store.py``), so the capture exits at once.  It
  stores now instead when the store refused the registration or a driver asked it to (``keep_in_process``: the
  spawned ranks of a script are merged in this process).

Rank shards (``distributed.session.ShardSink``) and the launcher's merge (``distributed.launch.JobSink``) are the
other sinks; a remote store is one more: anything that satisfies ``tpudiag.session.Sink``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from tpudiag import deferred_store
from tpudiag.errors import TpudiagError
from tpudiag.model import Run
from tpudiag.session import Delivered, Finished
from tpudiag.store import Store
from tpudiag.store.feeder import SpoolFeeder


class StoreNow:
    def __init__(self, store: Store, register_at: str = "flush", feed_s: float | None = 10.0) -> None:
        self.store = store
        self._register_at = register_at
        self._run: Run | None = None
        self._registered = False
        self.registration_error: TpudiagError | None = None
        # While the code runs, the spool is loaded by a child process every ``feed_s`` seconds
        # (``store/feeder.py``: DuckDB stays out of the code's process); None: in this process, at each flush.
        self._feed_s = feed_s
        self._feeder: SpoolFeeder | None = None

    @property
    def defers(self) -> bool:
        return False

    @property
    def spool_dir(self) -> Path:
        assert self._run is not None and self._run.artifacts_dir is not None
        return Path(self._run.artifacts_dir) / "spool"

    def begin(self, run: Run) -> None:
        self._run = run
        if self._register_at == "begin":
            self.store.put_run(run)
            self._registered = True
        if self._feed_s is not None and run.artifacts_dir is not None:
            # Started now, it imports while the script starts; it touches the store from the first flush on.
            run_dir = Path(run.artifacts_dir)
            self._feeder = SpoolFeeder(self.store.path.resolve(), run, run_dir, self.spool_dir, self._feed_s)
            self._feeder.start_early()

    def flush(self) -> None:
        if self._run is None or self.registration_error is not None:
            return
        if self._feeder is not None and self._feeder.start():
            return
        if not self._registered:
            try:
                self.store.put_run(self._run, replace=False)  # late (a slow lock): never over the final record
            except TpudiagError as err:
                self.registration_error = err  # the store write at the end meets it again and says so
                return
            self._registered = True
        with contextlib.suppress(TpudiagError):
            self.store.ingest_spool(self._run.id, self.spool_dir)

    def stop_feeding(self) -> None:
        """The feeder leaves before the final store write (one writer at a time)."""
        if self._feeder is not None:
            self._feeder.stop()

    def deliver(self, finished: Finished) -> Delivered:
        self.stop_feeding()
        run = finished.run
        if finished.jobs:  # a sink that stores now never lets collectors defer; jobs handed anyway run here
            deferred_store.write_run_file(Path(run.artifacts_dir or self.store.run_dir(run.id)), run, finished.jobs)
            return Delivered(deferred_store.finish(self.store, run.id), True)
        self.store.store_finished(run, self.spool_dir)
        with contextlib.suppress(OSError):
            deferred_store.remove_empty_tree(self.spool_dir)
        return Delivered(run, True)


class StoreLater(StoreNow):
    def __init__(self, store: Store, feed_s: float | None = 10.0) -> None:
        super().__init__(store, register_at="flush", feed_s=feed_s)
        self._stay = False

    def keep_in_process(self) -> None:
        """Store the run in this process after all (asked before the session stops)."""
        self._stay = True

    @property
    def defers(self) -> bool:
        return not self._stay and self.registration_error is None

    def deliver(self, finished: Finished) -> Delivered:
        if not self.defers:
            return super().deliver(finished)
        self.stop_feeding()
        run = finished.run
        run_dir = Path(run.artifacts_dir or self.store.run_dir(run.id))
        if deferred_store.hand_off(self.store, run, finished.jobs, run_dir):
            return Delivered(run, False)
        # No child could start: the deferred work is done here.
        deferred_store.write_run_file(run_dir, run, finished.jobs)
        return Delivered(deferred_store.finish(self.store, run.id), True)
