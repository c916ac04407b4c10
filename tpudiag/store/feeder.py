"""A running capture's spool, loaded into the store from a child process (``python -m tpudiag.store.feeder``).

While the script runs, its collectors write Parquet parts to the run's spool folder; the store shows a running job
(the dashboard, ``report``) once those parts are loaded.  Loading them in the script's own process, as the capture
did, put DuckDB and its buffers into that process: +160 MB of RSS from the first flush on (issue 21's bench loop:
337 -> 465 MB with nothing but the compile collector), and the load's CPU on a thread beside the training loop every
10 s.  The feeder does it instead, in the idle class (``tpudiag.processes``), without torch:

- the parent writes the run's first record to ``<run dir>/feeder.json`` and starts the child at the first flush;
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

from tpudiag.cadence import unwatched_interval
from tpudiag.errors import TpudiagError
from tpudiag.model import Run
from tpudiag.processes import BACKGROUND_GROUP, lower_priority, make_background, pid_alive
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

    def start(self) -> bool:
        """Start the child once; False when it could not start (the caller loads the spool itself)."""
        if self.proc is not None:
            return self.proc.poll() is None
        if self.failed is not None:
            return False
        try:
            (self.run_dir / STOP_FILE).unlink(missing_ok=True)
            (self.run_dir / RUN_FILE).write_text(json.dumps(dataclasses.asdict(self.run)))
            with open(self.run_dir / LOG_FILE, "ab") as log:
                self.proc, self.line = start_child(
                    [
                        sys.executable, "-m", "tpudiag.store.feeder", str(self.db), str(self.run_dir),
                        str(self.spool_dir), str(os.getpid()), str(self.interval_s),
                    ],
                    stdout=log, stderr=log, process_group=BACKGROUND_GROUP,
                )  # fmt: skip
            make_background(self.proc.pid)
        except OSError as err:
            self.failed = str(err)
            return False
        live_loads.start(Store(self.db).runs_dir, self.run.id)
        return True

    def stop(self, wait_s: float = 60.0) -> None:
        """Ask the child to leave and wait for it (it finishes the load it is in)."""
        proc = self.proc
        if proc is None:
            return
        with contextlib.suppress(OSError):
            (self.run_dir / STOP_FILE).touch()
        if self.line is not None:
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


def main(argv: list[str]) -> int:
    db, run_dir, spool_dir, parent, interval = Path(argv[0]), Path(argv[1]), Path(argv[2]), int(argv[3]), float(argv[4])
    lower_priority(NICE)  # the idle class where there is one (tpudiag.processes)
    run = Run.from_record(json.loads((run_dir / RUN_FILE).read_text()))
    store = Store(db)
    registered = False
    started = next_load = time.monotonic()
    # A look a second for a whole run, on a core the script may need: plain strings and syscalls (a look with
    # pathlib's objects cost ~30 us of CPU, ~6x this).
    stop, want, exists = os.fspath(run_dir / STOP_FILE), live_loads.want_path(store.runs_dir, run.id), os.path.exists
    line = ParentLine()
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
