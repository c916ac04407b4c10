"""The capture session: start collectors, run the target as Python would, stop, store the run.

The store is opened only in short write sessions: once to register the run (status ``running``), periodically to
load spooled parts, and once at the end.  That last one, with the analysis of the last trace chunk, runs in a
detached child once the script's exit status is known (``deferred_store``; ``--wait`` keeps it in this process).
A capture killed with SIGKILL leaves its run ``running`` with its spool on disk; the next tpudiag command on that
host loads the spool and marks the run ``interrupted``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpudiag import deferred_store, environment, internal_errors, runner
from tpudiag.clock import Clock, SystemClock
from tpudiag.errors import StoreError, TpudiagError, UsageError
from tpudiag.model import Run
from tpudiag.plugins import CaptureContext, Collector, load_collectors
from tpudiag.run_setup import RunStart, prepare_run, start_collectors
from tpudiag.spool import Spool
from tpudiag.store import Store


@dataclass
class CaptureOptions:
    db: Path
    name: str | None = None
    collect: list[str] | None = None  # None: every available collector
    # How often spooled parts are loaded into the store while the script runs.
    flush_interval_s: float = field(default_factory=lambda: float(os.environ.get("TPUDIAG_FLUSH_S", "10")))
    collector_options: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None  # launchers only: the job's run id, the same on every node (distributed/multinode.py)
    # Store the run before returning; otherwise a detached child stores it after the script's exit (deferred_store).
    wait: bool = field(default_factory=lambda: os.environ.get("TPUDIAG_WAIT", "") not in ("", "0"))


@dataclass
class CaptureResult:
    run_id: str
    exit_code: int
    status: str
    collectors: list[Collector]
    context: CaptureContext
    stored: bool  # False: a detached child is storing it (every reader waits for it)
    internal_errors: str | None = None  # the closing line about tpudiag's own failures, if there were any


def _warn(text: str) -> None:
    sys.stderr.write(f"tpudiag: {text}\n")
    sys.stderr.flush()


class _Flusher(threading.Thread):
    """Every few seconds while the script runs (``TPUDIAG_FLUSH_S``, 10): registers the run (status ``running``) the
    first time, then loads spooled parts into the store.  A script shorter than that never loads DuckDB in its own
    process (its store write after the script registers it): DuckDB's import and open (~0.15 s, most of it holding
    the GIL) neither delay the script's start nor slow its first steps."""

    def __init__(self, store: Store, run: Run, spool: Spool, collectors: list[Collector], interval: float):
        super().__init__(name="tpudiag-flusher", daemon=True)
        self._store, self._run, self._run_id, self._spool = store, run, run.id, spool
        self._collectors, self._interval = collectors, interval
        self._stop_event = threading.Event()
        self.registration_error: TpudiagError | None = None

    def run(self) -> None:
        registered = False
        while not self._stop_event.wait(self._interval):
            if not registered:
                try:
                    self._store.put_run(self._run, replace=False)  # late (a slow lock): never over the final record
                except TpudiagError as err:
                    self.registration_error = err  # the capture's own store write meets it again and says so
                    return
                registered = True
            for c in self._collectors:
                with contextlib.suppress(Exception):
                    c.flush()
            with contextlib.suppress(TpudiagError):
                self._store.ingest_spool(self._run_id, self._spool.directory)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


def capture(target: runner.Target, options: CaptureOptions, clock: Clock | None = None) -> CaptureResult:
    clock = clock or SystemClock()
    runner.check_target(target)
    # Threads started during set-up (DuckDB's, the profiler's, the flusher) leave SIGINT/SIGTERM to the thread
    # that runs the script.
    with runner.signals_to_main_thread():
        store = Store(Path(options.db).absolute())  # the script may chdir: every later write must not follow it
        store.check_file()
        collectors = load_collectors(options.collect)

        script_path = Path(target.name) if target.kind == "script" else Path.cwd()
        name = options.name or (Path(target.name).stem if target.kind == "script" else target.name)
        run, run_dir = prepare_run(store, clock, RunStart(name, target.display, target.args, script_path), collectors)
        run_id = run.id
        spool = Spool(run_dir / "spool")
        errors = internal_errors.begin(run_dir)
        ctx = CaptureContext(
            run_id=run_id, run_dir=run_dir, spool=spool, options=dict(options.collector_options), clock=clock
        )
        active = start_collectors(collectors, ctx)
        flusher = _Flusher(store, run, spool, active, options.flush_interval_s)
        flusher.start()
    from tpudiag.distributed import reach  # spawned and elastic-agent workers become ranks of this run

    spawned = reach.install(run_id, run_dir, options.collect, options.collector_options, options.flush_interval_s, ctx)
    t0 = clock.monotonic()
    outcome = runner.run(target)
    duration = clock.monotonic() - t0
    if spawned is not None:
        spawned.remove()
    flusher.stop()
    # Spawned ranks are merged here, below; a store that refused the registration is reported here too.
    detach = not options.wait and not (spawned is not None and spawned.used) and flusher.registration_error is None
    ctx.options["defer_analysis"] = detach

    for c in reversed(active):
        try:
            c.stop()
        except Exception as err:
            ctx.note(f"collector {c.name} failed while stopping: {err}")
    if spawned is not None:
        spawned.settle_notes(ctx)

    kind, device_name = environment.device()
    errors_line = errors.closing_line()
    final = dataclasses.replace(
        run,
        status=outcome.status,
        exit_code=outcome.exit_code,
        duration_s=round(duration, 6),
        torch_version=environment.torch_version(),
        device_kind=kind,
        device_name=device_name,
        precision={**environment.precision(), **ctx.metadata.get("precision", {})},
        notes=([f"{internal_errors.NOTE_PREFIX} {errors_line}"] if errors_line else [])
        + list(ctx.notes)
        + ([f"script ended with {outcome.error}"] if outcome.error else []),
    )
    if detach and deferred_store.hand_off(store, final, run_dir):
        return CaptureResult(run_id, outcome.exit_code, outcome.status, active, ctx, False, errors_line)
    if detach:  # no child could start: the deferred work is done here
        deferred_store.write_run_file(run_dir, final)
        final = deferred_store.finish(store, run_id)
    else:
        store.store_finished(final, spool.directory)
    if spawned is not None:
        final = spawned.merge(store, final)
    with contextlib.suppress(OSError):
        deferred_store.remove_empty_tree(spool.directory)
    return CaptureResult(run_id, outcome.exit_code, outcome.status, active, ctx, True, errors_line)


def run_capture_cli(target: runner.Target, options: CaptureOptions) -> int:
    """The capture command's body: capture, print the one closing line, return the script's exit code."""
    from tpudiag.distributed.launcher_target import is_launcher, normalize

    target = normalize(target)
    if options.run_id and not is_launcher(target):
        raise UsageError("--run-id joins the nodes of one distributed job: needs torchrun (-m torch.distributed.run)")
    try:
        if is_launcher(target):
            from tpudiag.distributed import launch

            result = launch.capture_launcher(target, options)
        else:
            result = capture(target, options)
    except StoreError as err:
        # The script may already have run; its data stays in the spool for the next command to recover.
        _warn(str(err))
        return err.exit_code
    if result.internal_errors:
        _warn(result.internal_errors)
    for note in result.context.notes:
        _warn(f"note: {note}")
    later = "" if result.stored else " in the background (tpudiag commands wait for it)"
    _warn(f"run {result.run_id} ({result.status}, exit {result.exit_code}) stored in {options.db}{later}")
    return result.exit_code
