"""Each finished trace window analysed off the training process, at low priority, and the disk cap.

The trace collector stops a window's profiler session at a step boundary, exports its Chrome trace to
``trace/kineto-NNN.json`` and leaves a job file ``trace/jobs/window-NNN.json``. A worker process of its own
(``python -m tpudiag.longrun.analyst``, in the idle scheduling class, else ``nice`` 10:
``processes.lower_priority``; started with the capture, importing at the script's priority until the script's
first step: ``processes.early_start``) analyses each job into spool parts named after the window
(trace_events, steps, and the window's own row), then removes the job. Parts named after the window make the work
idempotent: whatever runs a job a second time (the capture's deferred ``finish`` after the worker died, or both at
once) rewrites the same parts instead of adding copies. The worker leaves when the job folder holds a ``STOP`` file
and no job, or when the capture's process is gone. Between jobs it sleeps on its line to the capture
(``tpudiag.wake_line``), which pokes it at each job and at the stop: no polling while a long run has no window.

Disk (``--max-disk``): the windows' trace files are counted as they are exported.  Over the cap, the oldest
scheduled window's file is deleted (its analysed rows stay, marked ``pruned``); anomaly windows are kept; when
nothing is left to prune, scheduled windows stop opening.  The pulse is never pruned.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpudiag import no_pandas
from tpudiag.atomic_file import atomic_file
from tpudiag.processes import BACKGROUND_GROUP, early_start, lower_priority, make_background, pid_alive
from tpudiag.wake_line import Line, ParentLine, start_child

JOBS = "jobs"
STOP = "STOP"
LOG = "analyst.log"
EVENT_ID_STRIDE = 100_000_000  # window k's events are numbered from k * stride: ids unique without a counter
DEFAULT_MAX_DISK = 2 << 30
NICE = 10
IDLE_CHECK_S = 5.0  # an idle worker looks at its files this often without a poke (the capture pokes it: wake_line)
_FALLBACK_POLL_S = 0.25  # ... and this often where it has no line


def first_event_id(window_id: int) -> int:
    return window_id * EVENT_ID_STRIDE


def write_job(trace_dir: Path, job: dict[str, Any]) -> Path:
    folder = trace_dir / JOBS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"window-{int(job['window_id']):04d}.json"
    with atomic_file(path, "w") as fh:
        json.dump(job, fh)
    return path


def pending_jobs(trace_dir: Path) -> list[Path]:
    """The jobs waiting, oldest first.  The worker polls this several times a second for a whole run, on a core the
    script may need: names are listed and filtered as plain strings, paths made only for the jobs found (with
    pathlib's objects for every entry, an idle poll cost ~50 us of CPU, ~5x this)."""
    folder = os.path.join(trace_dir, JOBS)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [Path(folder, n) for n in sorted(names) if n.startswith("window-") and n.endswith(".json")]


# A collector's extra analysis of each window (the memory collector's allocator view): "module:function" called as
# ``fn(ctx, path, trace, tables, part)``, named by the trace collector so this core module imports no collector.
WINDOW_HOOK = "tpudiag.collectors.trace:analyse_window_extras"


def _hook(spec: str | None) -> Any:
    if not spec:
        return None
    import importlib

    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def run_job(run_id: str, spool: Any, job_path: Path, hook: str | None = None) -> int:
    """Analyse one window job into ``spool``; its event count.  The job file is removed once done."""
    from tpudiag.model import TraceWindow
    from tpudiag.traces import kineto, kineto_tables

    try:
        job = json.loads(job_path.read_text())
    except FileNotFoundError:
        return 0  # done by someone else meanwhile
    wid = int(job["window_id"])
    part = f"window-{wid:04d}"
    path = Path(job["path"])
    events = 0
    if path.exists():
        trace = kineto.load(path)
        events = len(trace)
        if events:
            tables = kineto_tables.to_tables(
                trace,
                run_id=run_id,
                first_event_id=int(job["first_event_id"]),
                first_step=int(job.get("first_step") or 0),
                whole_fallback=wid == 0,
                module_sources=job.get("sources"),
                root_inputs=job.get("roots") or [],
            )
            spool.write_table("trace_events", tables.events, part=part)
            spool.write_table("steps", kineto_tables.steps_table(tables.steps, run_id), part=part)
            extra = _hook(hook)
            if extra is not None:
                from tpudiag.plugins import CaptureContext

                options = {"profile_memory": bool(job.get("profile_memory"))}
                ctx = CaptureContext(run_id=run_id, run_dir=Path(job["run_dir"]), spool=spool, options=options)
                extra(ctx, path, trace, tables, part)
    row = TraceWindow(
        run_id=run_id,
        window_id=wid,
        reason=str(job["reason"]),
        first_step=job.get("first_step"),
        last_step=job.get("last_step"),
        start_ns=int(job["start_ns"]),
        end_ns=int(job["end_ns"]),
        trace_events=events,
        first_event_id=int(job["first_event_id"]),
        rank=int(job.get("rank") or 0),
        detail=job.get("detail"),
        numerics=bool(job.get("numerics")),
        path=str(path),
    )
    from tpudiag.model import records_to_arrow

    spool.write_table(TraceWindow.TABLE, records_to_arrow(TraceWindow, [row]), part=part)
    with contextlib.suppress(FileNotFoundError):
        job_path.unlink()
    return events


def run_pending(run_id: str, spool: Any, trace_dir: Path, hook: str | None = WINDOW_HOOK) -> int:
    """Every job still waiting (the capture's deferred finish); how many were run."""
    jobs = pending_jobs(trace_dir)
    for job in jobs:
        run_job(run_id, spool, job, hook)
    tidy(trace_dir)
    return len(jobs)


def tidy(trace_dir: Path) -> None:
    """Remove the job folder once it holds nothing but the STOP file."""
    folder = trace_dir / JOBS
    if not pending_jobs(trace_dir):
        with contextlib.suppress(OSError):
            (folder / STOP).unlink(missing_ok=True)
            folder.rmdir()


class Worker:
    """The analysis process of one capture: started with the capture (``start``), else at the first job."""

    def __init__(self, run_id: str, run_dir: Path, trace_dir: Path) -> None:
        self.run_id, self.run_dir, self.trace_dir = run_id, run_dir, trace_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.line: Line | None = None
        self.failed: str | None = None
        self.kicked = False  # a job was handed to it

    def start(self) -> None:
        """Start the worker with the capture, before the script's code: it imports what a job needs at the
        script's priority while the script starts, then waits in the idle class (``processes.early_start``)."""
        self._spawn(early=True)

    def kick(self) -> None:
        """A job is waiting: wake the worker, or start it."""
        self.kicked = True
        if self.proc is not None and self.proc.poll() is None:
            if self.line is not None:
                self.line.poke()
            return
        self._spawn(early=False)

    def _spawn(self, early: bool) -> None:
        if self.failed:
            return
        if self.line is not None:
            self.line.close()  # the last worker's
        try:
            with open(self.trace_dir / LOG, "ab") as log:
                self.proc, self.line = start_child(
                    [
                        sys.executable,
                        "-m",
                        "tpudiag.longrun.analyst",
                        str(self.run_dir),
                        self.run_id,
                        str(self.trace_dir),
                        str(os.getpid()),
                        *(["early"] if early else []),
                    ],
                    stdout=log,
                    stderr=log,
                    process_group=BACKGROUND_GROUP,  # no Ctrl-C; the script's scheduling group (tpudiag.processes)
                    cwd=self.trace_dir,  # not the user's folder: a module of theirs cannot shadow one tpudiag imports
                )
            if early:
                early_start(self.proc)
            else:
                make_background(self.proc.pid)
        except OSError as err:
            self.failed = str(err)

    def stop(self, wait_s: float) -> None:
        """Ask the worker to leave once its queue is empty; wait up to ``wait_s`` (what is left is run later)."""
        with contextlib.suppress(OSError):
            (self.trace_dir / JOBS).mkdir(parents=True, exist_ok=True)
            (self.trace_dir / JOBS / STOP).touch()
        if self.proc is None:
            return
        if not self.kicked:
            # Started early and never handed a job (a script that ended inside its first window): nothing of its
            # own in progress, and the job the caller left is the caller's (or the deferred finish's) to run.
            wait_s = 0.0
        elif self.line is not None:
            self.line.poke()
        try:
            self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.proc.terminate()  # the one it started; its unfinished job stays for the deferred finish
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        if self.line is not None:
            self.line.close()


@dataclass
class DiskCap:
    """The windows' trace files against ``--max-disk`` (bytes)."""

    max_bytes: int = DEFAULT_MAX_DISK
    files: list[tuple[int, str, Path, int]] = field(default_factory=list)  # (window id, reason, path, bytes)
    pruned: list[int] = field(default_factory=list)

    def used(self) -> int:
        return sum(size for _, _, _, size in self.files)

    def add(self, window_id: int, reason: str, path: Path) -> None:
        try:
            size = path.stat().st_size
        except OSError:
            return
        self.files.append((window_id, reason, path, size))

    def make_room(self, busy: set[int]) -> bool:
        """Prune scheduled windows (oldest first, not ``busy`` ones still being analysed) until under the cap;
        False when still over it."""
        while self.used() >= self.max_bytes:
            victim = next((f for f in self.files if f[1] == "schedule" and f[0] not in busy), None)
            if victim is None:
                return False
            self.files.remove(victim)
            with contextlib.suppress(OSError):
                victim[2].unlink()
            self.pruned.append(victim[0])
        return True

    def allows(self, reason: str, busy: set[int]) -> bool:
        """Whether a window of ``reason`` may open: a scheduled one only under the cap (after pruning), an anomaly
        window while anomaly windows alone stay under twice the cap."""
        if reason in ("schedule", "first_steps"):
            return self.make_room(busy)
        self.make_room(busy)
        return self.used() < 2 * self.max_bytes


def parse_size(text: str) -> int:
    """``500MB``, ``2G``, ``1.5GB``, ``1000000`` -> bytes."""
    from tpudiag.errors import UsageError

    raw = str(text).strip().upper().rstrip("B")
    scale = 1
    for suffix, mult in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if raw.endswith(suffix):
            raw, scale = raw[:-1], mult
            break
    try:
        value = float(raw) * scale
    except ValueError:
        raise UsageError(f"--max-disk {text!r}: expected a size such as 500MB or 2GB") from None
    if value <= 0:
        raise UsageError(f"--max-disk {text!r}: must be more than 0")
    return int(value)


def _import_for_jobs() -> None:
    """What ``run_job`` imports (~0.4 s of CPU), before the worker lowers itself (``processes.early_start``)."""
    import pyarrow.parquet  # noqa: F401  (the spool's parts)

    import tpudiag.model
    import tpudiag.plugins
    import tpudiag.traces.kineto
    import tpudiag.traces.kineto_tables  # noqa: F401

    _hook(WINDOW_HOOK)


def main(argv: list[str]) -> int:
    """The worker: ``python -m tpudiag.longrun.analyst RUN_DIR RUN_ID TRACE_DIR PARENT_PID [early]``."""
    from tpudiag.spool import Spool

    no_pandas.skip()  # (pyarrow's first array would import it: ~0.5 s of CPU and ~45 MB of RSS for nothing)
    _import_for_jobs()  # at the script's priority where the capture started this worker early ...
    lower_priority(NICE)  # ... then the idle class where there is one (tpudiag.processes)
    run_dir, run_id, trace_dir, parent = Path(argv[0]), argv[1], Path(argv[2]), int(argv[3])
    spool = Spool(run_dir / "spool")
    stop = os.fspath(trace_dir / JOBS / STOP)  # (looked for as a plain string: see ``pending_jobs``)
    line = ParentLine()
    # Started early (``Worker.start``), it takes no job before the capture hands it one (``kick``: a poke): the job
    # of a script that ended inside its first window is the capture's, or its deferred finish's.
    awake = argv[4:5] != ["early"] or not line.open
    while True:
        jobs = pending_jobs(trace_dir) if awake else []
        for job in jobs:
            try:
                run_job(run_id, spool, job, WINDOW_HOOK)
            except Exception as err:  # the job stays for the deferred finish, which says why if it fails again
                sys.stderr.write(f"{time.strftime('%H:%M:%S')} {job.name}: {err!r}\n")
                return 1
        if not jobs:
            if os.path.exists(stop) or not pid_alive(parent):
                return 0
            if line.wait(IDLE_CHECK_S, _FALLBACK_POLL_S):  # a poke: a job, or the STOP file
                awake = True


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
