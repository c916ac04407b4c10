"""A running capture's spool, loaded into the store from a child process (``python -m tpudiag.store.feeder``).

While the script runs, its collectors write Parquet parts to the run's spool folder; the store shows a running job
(the dashboard, ``report``) once those parts are loaded.  Loading them in the script's own process, as the capture
did, put DuckDB and its buffers into that process: +160 MB of RSS from the first flush on (issue 21's bench loop:
337 -> 465 MB with nothing but the compile collector), and the load's CPU on a thread beside the training loop every
10 s.  The feeder does it instead, in the idle class (``tpudiag.processes``), without torch:

- the parent starts the child with the capture, before the script's code: it imports DuckDB and pyarrow at the
  script's priority while the script starts, and lowers itself (``processes.early_start``); at the first flush the
  parent writes the run's first record to ``<run dir>/feeder.json`` (or starts the child then, if it had not);
- at once, then on a clock that slows as the run gets older (``cadence.unwatched_interval``), and whenever a reader
  of the store asks (``store/live_loads.py``), the child registers the run (never over a record already there) and
  loads the parts that are finished (``Store.ingest_spool``: each part at most once, deleted after the commit);
- it leaves when ``<run dir>/feeder.stop`` appears (the parent waits for it before its own final store write: one
  writer at a time, and loads whatever is left itself, as before), or after one last load when the parent is gone
  (killed: what it had flushed is kept).  It sleeps on its line to the capture (``tpudiag.wake_line``): the stop
  wakes it at once, a dead parent too, a reader's request within a second.

Where no child can start, the caller loads the spool in its own process (``SpoolFeeder.start`` returns False).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tpudiag.atomic_file import atomic_file
from tpudiag.cadence import unwatched_interval
from tpudiag.errors import TpudiagError
from tpudiag.model import Run
from tpudiag.processes import BACKGROUND_GROUP, early_start, lower_priority, make_background, pid_alive
from tpudiag.store import live_loads
from tpudiag.store.database import Store
from tpudiag.wake_line import Line, ParentLine, start_child

RUN_FILE = "feeder.json"
STOP_FILE = "feeder.stop"
LOG_FILE = "feeder.log"
NICE = 10
# Between loads the feeder sleeps on its line to the capture (``tpudiag.wake_line``: poked at the stop, closed when
# the capture dies), waking this often to look for a reader's request (``live_loads``: a reader waits up to 2 s)
# and its parent's pid: once a second, not the five polls a second it made before.
WANT_CHECK_S = 1.0
_FALLBACK_POLL_S = 0.2  # ... and this often where it has no line


class SpoolFeeder:
    def __init__(self, db: Path, run: Run, run_dir: Path, spool_dir: Path, interval_s: float) -> None:
        self.db, self.run, self.run_dir, self.spool_dir, self.interval_s = db, run, run_dir, spool_dir, interval_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.line: Line | None = None
        self.failed: str | None = None
        self.started = False  # ``start`` (the first flush) came: the child may load

    def start_early(self) -> None:
        """Start the child with the capture, before the script's code: it imports DuckDB and pyarrow at the
        script's priority while the script starts (``processes.early_start``), then waits in the idle class for
        ``start`` (the first flush) before it touches the store."""
        if self.proc is None and self.failed is None:
            self._spawn(early=True)

    def start(self) -> bool:
        """The first flush: the child (started now, or early) registers the run and loads the spool from now on;
        False when it could not start (the caller loads the spool itself)."""
        if self.started:
            return self.proc is not None and self.proc.poll() is None
        if self.failed is not None:
            return False
        try:
            with atomic_file(self.run_dir / RUN_FILE, "w") as fh:  # the child waits for it whole
                fh.write(json.dumps(dataclasses.asdict(self.run)))
        except OSError as err:
            self.failed = str(err)
            return False
        self.started = True
        if self.proc is not None and self.proc.poll() is None:
            if self.line is not None:
                self.line.poke()
        elif not self._spawn(early=False):
            return False
        live_loads.start(Store(self.db).runs_dir, self.run.id)
        return True

    def _spawn(self, early: bool) -> bool:
        try:
            (self.run_dir / STOP_FILE).unlink(missing_ok=True)
            with open(self.run_dir / LOG_FILE, "ab") as log:
                self.proc, self.line = start_child(
                    [
                        sys.executable, "-m", "tpudiag.store.feeder", str(self.db), str(self.run_dir),
                        str(self.spool_dir), str(os.getpid()), str(self.interval_s),
                    ],
                    stdout=log, stderr=log, process_group=BACKGROUND_GROUP,
                )  # fmt: skip
            if early:
                early_start(self.proc)
            else:
                make_background(self.proc.pid)
        except OSError as err:
            self.failed = str(err)
            return False
        return True

    def stop(self, wait_s: float = 60.0) -> None:
        """Ask the child to leave and wait for it (it finishes the load it is in)."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(OSError):
            (self.run_dir / STOP_FILE).touch()
        if not self.started:
            wait_s = 0.0  # started early, never asked to load (no flush came): nothing to finish
        elif self.line is not None:
            self.line.poke()
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if self.line is not None:
            self.line.close()
        for name in (STOP_FILE, RUN_FILE):
            with contextlib.suppress(OSError):
                (self.run_dir / name).unlink()
        if self.started:
            live_loads.stop(Store(self.db).runs_dir, self.run.id)


def _parent_alive(pid: int) -> bool:
    """The capture that started this child still runs (and its id was not reused: it is still our parent)."""
    return pid_alive(pid) and os.getppid() == pid


def _load_once(store: Store, run: Run, spool_dir: Path, registered: bool) -> bool:
    try:
        if not registered:
            store.put_run(run, replace=False)
            registered = True
        store.ingest_spool(run.id, spool_dir)
    except TpudiagError as err:  # a busy or refused store: the next round (or the final write) tries again
        print(f"tpudiag feeder: {err}", file=sys.stderr, flush=True)
    return registered


def _import_for_loads() -> None:
    """What a load imports (~0.3 s of CPU), before the feeder lowers itself (``processes.early_start``)."""
    import duckdb  # noqa: F401
    import pyarrow.parquet  # noqa: F401

    import tpudiag.store.bulk_insert  # noqa: F401


def _wait_for_run(run_dir: Path, parent: int, line: ParentLine) -> Run | None:
    """Started early: the run's record once the first flush writes it; None when the capture stops (or dies)
    first."""
    record, stop = run_dir / RUN_FILE, os.fspath(run_dir / STOP_FILE)
    while not os.path.exists(stop) and _parent_alive(parent):
        try:
            return Run.from_record(json.loads(record.read_text()))
        except FileNotFoundError:
            line.wait(WANT_CHECK_S, _FALLBACK_POLL_S)  # a poke: the record, or the stop
    return None


def main(argv: list[str]) -> int:
    db, run_dir, spool_dir, parent, interval = Path(argv[0]), Path(argv[1]), Path(argv[2]), int(argv[3]), float(argv[4])
    _import_for_loads()  # at the script's priority where the capture started this child early ...
    lower_priority(NICE)  # ... then the idle class where there is one (tpudiag.processes)
    line = ParentLine()
    run = _wait_for_run(run_dir, parent, line)
    if run is None:
        return 0
    store = Store(db)
    registered = False
    started = next_load = time.monotonic()
    # A look a second for a whole run, on a core the script may need: plain strings and syscalls (a look with
    # pathlib's objects cost ~30 us of CPU, ~6x this).
    stop, want, exists = os.fspath(run_dir / STOP_FILE), live_loads.want_path(store.runs_dir, run.id), os.path.exists
    while not exists(stop):
        if not _parent_alive(parent):
            # The capture died (killed?): what its collectors had flushed is loaded once more, nobody else will.
            _load_once(store, run, spool_dir, registered)
            live_loads.stop(store.runs_dir, run.id)
            break
        if time.monotonic() >= next_load or exists(want):  # on its clock, or a reader asks (store/live_loads.py)
            registered = _load_once(store, run, spool_dir, registered)
            live_loads.mark_loaded(store.runs_dir, run.id)
            now = time.monotonic()
            next_load = now + unwatched_interval(interval, now - started)  # longer as the run gets older
        line.wait(max(0.0, min(WANT_CHECK_S, next_load - time.monotonic())), _FALLBACK_POLL_S)  # a poke: the stop
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
