"""``tpudiag capture script.py``: the capture session around a script run as Python would run it.

The store is opened only in short write sessions: at the first flush to register the run (status ``running``),
periodically to load spooled parts, and once at the end.  That last one, with the analysis of the last trace chunk,
runs in a detached child once the script's exit status is known (``sinks.StoreLater``; ``--wait`` keeps it in this
process: ``sinks.StoreNow``).  A capture killed with SIGKILL leaves its run ``running`` with its spool on disk; the
next tpudiag command on that host loads the spool and marks the run ``interrupted``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from tpudiag import forks, runner
from tpudiag.capture_options import CaptureOptions, CaptureResult
from tpudiag.clock import Clock, SystemClock
from tpudiag.errors import StoreError, UsageError
from tpudiag.plugins import load_collectors
from tpudiag.run_setup import RunStart, prepare_run
from tpudiag.session import CaptureSession
from tpudiag.sinks import StoreLater, StoreNow
from tpudiag.spool import Spool
from tpudiag.store_access import open_store


def _warn(text: str) -> None:
    sys.stderr.write(f"tpudiag: {text}\n")
    sys.stderr.flush()


def capture_script(
    target: runner.Target,
    options: CaptureOptions,
    clock: Clock | None = None,
    closing: Callable[[CaptureResult], None] | None = None,
) -> CaptureResult:
    """Capture the script's run and store it.  ``closing``: what the command prints once the run is stored; given,
    a SIGTERM that ends the script stores the run from its handler, prints that, and the process dies of the signal
    there, with the script's stack left as it was (``tpudiag.termination``)."""
    clock = clock or SystemClock()
    runner.check_target(target)
    # Threads started during set-up (DuckDB's, the profiler's, the flusher) leave SIGINT/SIGTERM to the thread
    # that runs the script.
    with runner.signals_to_main_thread():
        # Absolute: the script may chdir, and no later write may follow it.
        store = open_store(Path(options.db).absolute())
        store.check_file()
        collectors = load_collectors(options.collect)
        script_path = Path(target.name) if target.kind == "script" else Path.cwd()
        name = options.name or (Path(target.name).stem if target.kind == "script" else target.name)
        run, run_dir = prepare_run(store, clock, RunStart(name, target.display, target.args, script_path), collectors)
        feed_s = options.flush_interval_s
        sink = StoreNow(store, feed_s=feed_s) if options.wait else StoreLater(store, feed_s=feed_s)
        session = CaptureSession(
            run, run_dir, Spool(run_dir / "spool"), collectors, sink,
            options=options.collector_options, clock=clock, flush_s=options.flush_interval_s,
        )  # fmt: skip
        if options.remote:  # a one-process run goes to the bucket as a one-rank job once it is stored
            from tpudiag.remote import single

            single.prepare(options.remote, run_dir)
        session.start()
    from tpudiag.distributed import reach  # spawned and elastic-agent workers become ranks of this run

    spawned = reach.install(
        run.id, run_dir, options.collect, options.collector_options, options.flush_interval_s, session.ctx
    )

    def store_run(outcome: runner.Outcome) -> CaptureResult:
        """The run stored once the script has ended (or, at SIGTERM, from the signal handler: ``on_sigterm``)."""
        if spawned is not None:
            spawned.remove()
            if spawned.used and isinstance(sink, StoreLater):
                sink.keep_in_process()  # the ranks are merged here, below
        finished = session.stop(outcome)
        if spawned is not None:
            finished = spawned.settle(finished)
        try:
            delivered = session.deliver(finished)
        except (StoreError, OSError) as err:
            # The script has run: a store or run folder that failed meanwhile (a full disk, issue 21) degrades
            # the capture, never the script's exit status.  The spool stays in the run folder for the next command
            # to recover.
            session.note(f"the run could not be stored ({err}); the script's exit status stands")
            result = CaptureResult(run.id, outcome.exit_code, outcome.status, session.active, session.ctx, False)
            result.internal_errors = session.internal_errors_line
            return result
        if spawned is not None and delivered.stored:
            spawned.merge(store, delivered.run)
        if options.remote and delivered.stored:  # else the detached child that stores the run publishes it
            from tpudiag.remote import single

            why = single.publish_if_asked(store, delivered.run, run_dir)
            if why:
                session.note(why)
        result = CaptureResult(run.id, outcome.exit_code, outcome.status, session.active, session.ctx, delivered.stored)
        result.internal_errors = session.internal_errors_line
        return result

    def store_at_sigterm(outcome: runner.Outcome) -> None:
        assert closing is not None
        try:
            closing(store_run(outcome))
        except StoreError as err:  # (as the command says it when the script has ended)
            _warn(str(err))

    with runner.sigterm_restored():  # the caller's SIGTERM handling once the run is stored
        outcome = runner.run(target, on_sigterm=store_at_sigterm if closing is not None else None)
        if forks.in_child():  # a child the script forked ran on to its end: it exits as without tpudiag
            return CaptureResult(run.id, outcome.exit_code, outcome.status, [], session.ctx, False, forked_child=True)
        return store_run(outcome)


def run_capture_cli(target: runner.Target, options: CaptureOptions) -> int:
    """The capture command's body: capture, print the one closing line, return the script's exit code."""
    from tpudiag.distributed.launcher_target import is_launcher, normalize

    target = normalize(target)
    if options.run_id and not is_launcher(target):
        raise UsageError("--run-id joins the nodes of one distributed job: needs torchrun (-m torch.distributed.run)")
    upload = None
    if options.remote:
        from tpudiag.remote import JobUpload

        upload = JobUpload(options.remote)  # a bad URL or a missing client extra: a usage error, before the job
    try:
        if is_launcher(target):
            from tpudiag.distributed import launch

            result = launch.capture_launcher(target, options, upload=upload)
        else:
            result = capture_script(target, options, closing=lambda r: _closing(r, options))
    except StoreError as err:
        # The script may already have run; its data stays in the spool for the next command to recover.
        _warn(str(err))
        return err.exit_code
    if result.forked_child:
        return result.exit_code
    _closing(result, options)
    return result.exit_code


def _closing(result: CaptureResult, options: CaptureOptions) -> None:
    """The command's closing lines: tpudiag's own errors, the notes, where the run is stored."""
    if result.internal_errors:
        _warn(result.internal_errors)
    for note in result.context.notes:
        _warn(f"note: {note}")
    later = "" if result.stored else " in the background (tpudiag commands wait for it)"
    _warn(f"run {result.run_id} ({result.status}, exit {result.exit_code}) stored in {options.db}{later}")
