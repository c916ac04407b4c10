"""The trace collector for CPU and CUDA: torch.profiler (Kineto) around the whole script.

- shapes recorded; CUDA activity added when CUDA is available;
- every ``nn.Module`` forward is wrapped in a ``module::<path>`` range so ops carry their module path;
- the root module's input shapes are remembered per call, so steps can be tied to the input sizes that ran;
- a profiler session started by the script itself would crash Kineto if ours kept running (a nested session
  segfaults on torch 2.13), so ours pauses while the script's runs and resumes afterwards, and the run says so.

Each profiler session becomes one Chrome trace file kept in the run folder (``trace/kineto-NNN.json``), analysed
(nesting, self time, modules, steps) and spooled as trace_events and steps.  On long runs the session is rotated at
an optimizer-step boundary every ``trace_chunk_s`` seconds (default 30), so memory stays bounded and a capture that
is killed loses at most its last chunk; cutting at a step boundary keeps module ranges and steps whole.

Long runs (issue 21): by default the trace is not continuous.  A pulse record is kept for every step
(``collectors/pulse.py``), and the profiler runs in windows (``collectors/windows.py``): the first steps, then a few
steps now and then, and a window whenever a trigger fires.  Each window is one whole profiler session whose Chrome
trace is analysed by a low-priority process of its own (``tpudiag.longrun.analyst``).  A script that ends inside the
first window gets exactly the trace a whole-run capture gives.  ``--trace all`` (option ``trace="all"``) keeps the
continuous, rotated trace described above.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tpudiag import forks, internal_errors, runner
from tpudiag.collectors.long_run import NO_EVENTS, LongRunMixin
from tpudiag.longrun import analyst
from tpudiag.plugins import CaptureContext


def _quiet_stderr(fn: Any) -> Any:
    """Run ``fn`` with fd 2 sent to /dev/null.

    Kineto writes "USDT: ... profiler_start/profiler_stop" lines to stderr on every start and stop whatever its log
    level; the script's stderr must read as it would without tpudiag.  Only our own start/stop calls are wrapped.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        return fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class TraceCollector(LongRunMixin):
    name = "trace"
    description = (
        "`torch.profiler` (Kineto) around the whole script: CPU ops with shapes (and CUDA kernels on a GPU), "
        "module paths, steps, self times"
    )
    start_order = 10  # first: its profiler session spans the other collectors' start and stop

    def __init__(self) -> None:
        self._ctx: CaptureContext | None = None
        self._prof: Any = None
        self._own_inner: Any = None
        self._starting = False
        self._paused_for_user = False
        self._user_sessions = 0
        self._other_threads: dict[str, int] = {}  # thread name -> its root module calls (not the main thread's)
        self._chunks: list[Path] = []
        self._tracker: Any = None
        self._root_inputs: list[str | None] = []
        self._roots_done = 0  # root-forward inputs already consumed by written chunks
        self._steps_done = 0
        self._events_done = 0
        self._session_started = 0.0
        self._step_ended = False
        self._chunk_s = 30.0
        self._patches: list[tuple[Any, str, Any]] = []
        self._hooks: list[Any] = []
        self._main_thread = threading.main_thread()
        self._main_ident = self._main_thread.ident
        self._pulse: Any = None  # collectors/pulse.py PulseRecorder
        self._end_by_root: Any = None  # step_points.end_without_optimizer, once started
        self._plan: Any = None  # collectors/windows.py WindowPlan (None: --trace all)
        self._poller: Any = None
        self._worker: Any = None
        self._window_jobs: dict[int, dict[str, Any]] = {}
        self.profiler: Any = None  # the last torch.profiler.profile object (tests read key_averages from it)

    # -- plugin protocol --------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("torch") is not None

    def prepare(self, ctx: CaptureContext) -> None:
        """Before torch loads: keep libtpu from searching for a metadata server that is not there; the window
        analyst starts (``_prepare_long_run``)."""
        from tpudiag.collectors import tpu_profiler

        tpu_profiler.prepare_environment()
        self._prepare_long_run(ctx)

    def start(self, ctx: CaptureContext) -> None:
        import torch

        from tpudiag.collectors.modules import ModuleTracker, input_shapes

        self._ctx = ctx
        self._trace_dir = ctx.run_dir / "trace"
        self._trace_dir.mkdir(parents=True, exist_ok=True)
        self._activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            self._activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._with_stack = bool(ctx.options.get("with_stack"))
        # The allocator's events, for the memory collector's per-module and per-op view (collectors/memory_window.py)
        self._profile_memory = bool(ctx.options.get("profile_memory"))
        self._chunk_s = float(ctx.options.get("trace_chunk_s") or os.environ.get("TPUDIAG_TRACE_CHUNK_S") or 30.0)
        self._start_long_run(ctx)
        record_function = torch.autograd.profiler.record_function
        profiling_here = torch._C._autograd._profiler_enabled  # this thread's profiler state (thread-local)
        root_inputs = self._root_inputs
        get_ident, main_ident = threading.get_ident, self._main_ident
        from tpudiag.collectors.steady_steps import began_full

        def on_enter(path: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], is_root: bool) -> Any:
            if is_root:
                pulse = self._pulse
                if pulse is None:
                    if self._step_ended:
                        self._step_ended = False
                        if self._chunk_due():
                            self._rotate()
                elif get_ident() != main_ident:
                    # Steps are the main thread's (its optimizer steps, its root calls): no boundary here, and no
                    # root inputs kept (a server's thread pool, in a first window that no step closes, grew the
                    # list by a row per request for the whole job).
                    self._other_thread_call()
                    is_root = False
                elif pulse.started_ns is None or self._root_step(pulse, module):
                    # A step's first root forward (or a root call that ended the step in progress: root_steps.py)
                    if pulse.ended:  # ... after a step's end: the step boundary
                        pulse.ended = False
                        plan = self._plan
                        if plan is not None:
                            # Most steps of a long run: no window open, closing or coming, nothing to carry out.
                            if (
                                plan.close_next
                                or plan.next is not None
                                or plan.open is not None
                                or pulse.window_id is not None
                            ):
                                self._boundary()
                        elif self._chunk_due():
                            self._rotate()
                    roots = pulse.roots  # ``roots.began(id(module))``, without its frame (every step)
                    roots.step_root = roots.last_root = id(module)
                    pulse.step_begin(args, kwargs)
                    began_full(module, args, kwargs, pulse.started_ns)  # what the next steady steps must repeat
                if is_root and self._prof is not None:
                    root_inputs.append(input_shapes(args, kwargs))
            if self._prof is None or not profiling_here():
                # (``profiling_here``: the profiler records the thread that started it and the threads torch starts
                # for it; another thread's range would be an op call for nothing, at every module call.)
                return None
            rf = record_function("module::" + path)
            rf.__enter__()
            return rf

        def on_exit(path: str, token: Any) -> None:
            if token is not None:
                token.__exit__(None, None, None)

        self._tracker = ModuleTracker(on_enter, on_exit)
        try:
            self._tracker.install()
            self._hooks.append(forks.on_child("trace", self._let_go_in_child))
            from tpudiag.collectors import step_points

            self._end_by_root = step_points.end_without_optimizer
            on_step_end = self._pulse.step_end if self._pulse is not None else self._after_optimizer_step
            self._hooks.append(
                step_points.add(on_step_end, step_points.PULSE, "trace", by_root=True, steady=self._pulse)
            )
            self._patch_user_sessions()
            from tpudiag.collectors import tpu_profiler

            self._tpu = tpu_profiler.session_for(ctx)  # XProf trace through TorchTPU when a TPU is in use
            self._start_session()
        except BaseException:
            self._uninstall()
            raise

    def flush(self) -> None:
        """Chunks are cut at optimizer-step boundaries (see ``_after_optimizer_step``), not from other threads."""

    def stop(self) -> None:
        if self._ctx is None:
            return
        # The capture may leave the last chunk's analysis to ``finish`` (after the script's exit, off the user's
        # path).  Not with a TPU session: its events are numbered after the host's.
        deferred = self._ctx.can_defer and self._tpu is None
        try:
            if self._plan is not None:
                self._stop_windows(deferred)
            else:
                self._stop_session(analyse=not deferred)
            if self._tpu is not None:
                first = self._events_done if self._plan is None else analyst.first_event_id(self._plan.count)
                self._events_done += self._tpu.write(self._ctx, first_event_id=first)
        finally:
            self._uninstall()
            self._stop_pulse()
        if self._user_sessions:
            self._ctx.note(
                f"the script ran its own torch.profiler session {self._user_sessions} time(s); tpudiag's trace "
                "paused during it (its events are in the script's own trace)"
            )
        if self._other_threads:
            calls = sum(self._other_threads.values())
            names = ", ".join(sorted(self._other_threads)[:3]) + (", ..." if len(self._other_threads) > 3 else "")
            self._ctx.note(
                f"{calls:,} root module call(s) ran on other threads than the main one ({names}): torch's profiler "
                "and tpudiag's numerics checker see the thread that runs the script (and the threads torch starts "
                "for it), so their ops are not in the trace or the numerics, and the pulse's steps are the main "
                "thread's"
            )
        if self._events_done == 0 and not deferred and self._plan is None:
            self._ctx.note(NO_EVENTS)
        self._ctx.metadata["trace_files"] = [str(p) for p in self._chunks]

    def finish(self, ctx: CaptureContext, job: dict[str, Any]) -> None:
        """The deferred analysis the capture left with ``ctx.defer``, in any process: the last chunk (``--trace
        all``), or the trace windows still waiting for analysis (issue 21)."""
        if job.get("windows"):
            from tpudiag.longrun import analyst

            trace_dir = Path(job["trace_dir"])
            first = trace_dir / analyst.JOBS / "window-0000.json"
            only_first = first.exists() and len(analyst.pending_jobs(trace_dir)) == 1
            if only_first and analyst.run_job(ctx.run_id, ctx.spool, first, analyst.WINDOW_HOOK) == 0:
                ctx.note(NO_EVENTS)
            analyst.run_pending(ctx.run_id, ctx.spool, trace_dir)
            return
        path = Path(job["path"])
        ctx.options.setdefault("profile_memory", bool(job.get("profile_memory")))
        # Parts named after the chunk: a finish retried after its process died rewrites them, never duplicates.
        events, _steps = _analyse_chunk(
            ctx, path, job["first_event_id"], job["first_step"], job["sources"], job["roots"], part=path.stem
        )
        if job["first_event_id"] + events == 0:
            ctx.note(NO_EVENTS)

    # -- profiler sessions ------------------------------------------------------------------------------------
    def _after_optimizer_step(self, optimizer: Any) -> None:
        """Mark a step boundary (``step_points``: on the main thread, never while Dynamo traces); the chunk is cut
        at the next root-module forward if it is old enough.  (With a pulse, the pulse's ``step_end`` is the
        callback, and marks the boundary the same way: ``pulse.ended``.)

        Not here: the optimizer's own ``Optimizer.step#`` range is still open, and a profiler range that spans two
        sessions corrupts Kineto's heap (seen on torch 2.13).
        """
        self._step_ended = True

    def _other_thread_call(self) -> None:
        """A root module call on a thread other than the main one: counted for the run's note (a server's thread
        pool, a training function run in a thread).  Bounded: 64 thread names at most."""
        name = threading.current_thread().name
        calls = self._other_threads
        if name in calls or len(calls) < 64:
            calls[name] = calls.get(name, 0) + 1

    def _root_step(self, pulse: Any, module: Any) -> bool:
        """A root call while a step is in progress: whether it begins a new step (``collectors/root_steps.py``: a
        script without an optimizer step, or an evaluation between training steps).  If so the step in progress
        ends here, as at an optimizer step, and the caller makes the boundary as after one."""
        try:
            if not pulse.roots.begins(id(module), time.perf_counter_ns(), pulse.started_ns, pulse.slow.median_s):
                return False
            self._end_by_root()  # ``step_points.end_without_optimizer`` (bound at start: no import here)
            return pulse.started_ns is None
        except Exception as err:
            internal_errors.current().record("trace", "root step", err)
            return False

    def _chunk_due(self) -> bool:
        return (
            self._prof is not None
            and self._ctx is not None
            and self._ctx.clock.monotonic() - self._session_started >= self._chunk_s
        )

    def _rotate(self) -> None:
        # Runs inside the user's forward call: whatever goes wrong here must not reach their script.
        assert self._ctx is not None
        self._step_ended = False
        if threading.current_thread() is not self._main_thread or self._prof is None:
            return
        try:
            self._stop_session()
        except Exception as err:
            self._ctx.note(f"a trace chunk could not be written ({err}); later chunks continue")
        try:
            with runner.signals_to_main_thread():
                self._start_session()
        except Exception as err:
            self._ctx.note(f"trace stopped early: the profiler failed to restart ({err})")

    def _track_roots_only(self, on: bool) -> None:
        """Between sessions the tracker needs only root calls (a step's start): nested calls skip it."""
        tracker = self._tracker
        if tracker is not None and tracker.roots_only != on:
            from tpudiag.collectors import module_calls

            tracker.roots_only = on
            module_calls.refresh()

    def _start_session(self) -> None:
        import torch

        assert self._ctx is not None
        self._starting = True
        try:
            extra = self._tpu.profile_kwargs() if self._tpu is not None else {}
            prof = torch.profiler.profile(
                activities=self._activities + extra.get("activities", []),
                record_shapes=True,
                with_stack=self._with_stack,
                profile_memory=self._profile_memory,
                experimental_config=extra.get("experimental_config"),
            )
            forks.profiler_used()  # (a child forked from here must not run Kineto's exit handler: tpudiag.forks)
            _quiet_stderr(prof.start)
            if self._tpu is not None:
                self._tpu.start()
        finally:
            self._starting = False
        self._prof = prof
        self._track_roots_only(False)
        self._own_inner = getattr(prof, "profiler", None)
        self._session_started = self._ctx.clock.monotonic()
        self.profiler = prof

    def _stop_session(self, analyse: bool = True) -> None:
        """Stop the running session, keep its Chrome trace, and spool its analysed events (or, with ``analyse``
        false, leave them to ``finish``)."""
        import torch

        prof, self._prof = self._prof, None
        if prof is None:
            return
        self._track_roots_only(True)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()  # pending device work lands in the trace
        if self._tpu is not None:
            self._tpu.stop()  # synchronises pending device work first
        _quiet_stderr(prof.stop)
        number = len(self._chunks) if self._plan is None else self._window_number
        path = self._trace_dir / f"kineto-{number:03d}.json"
        prof.export_chrome_trace(str(path))
        self._chunks.append(path)
        if self._plan is not None:
            return  # the window's job (``_close_window``) takes it from here
        if analyse:
            self._write_chunk(path)
        else:
            self._defer_chunk(path)

    def _patch_user_sessions(self) -> None:
        from torch.autograd import profiler as autograd_profiler

        cls = autograd_profiler.profile
        collector = self
        orig_prepare = cls._prepare_trace
        orig_exit = cls.__exit__

        def _prepare_trace(prof_self: Any) -> Any:
            if collector._prof is not None and not collector._starting and prof_self is not collector._own_inner:
                collector._user_sessions += 1
                collector._paused_for_user = True
                with internal_errors.current().guard("trace", "pause for the script's profiler"):
                    if collector._plan is not None:
                        collector._pause_window()
                    else:
                        collector._stop_session()
            return orig_prepare(prof_self)

        def __exit__(prof_self: Any, *exc: Any) -> Any:
            result = orig_exit(prof_self, *exc)
            if collector._paused_for_user and prof_self is not collector._own_inner:
                collector._paused_for_user = False
                with internal_errors.current().guard("trace", "resume after the script's profiler"):
                    if collector._plan is not None:
                        collector._resume_window()
                    else:
                        collector._start_session()
            return result

        self._patches = [(cls, "_prepare_trace", orig_prepare), (cls, "__exit__", orig_exit)]
        cls._prepare_trace = _prepare_trace  # type: ignore[method-assign]
        cls.__exit__ = __exit__  # type: ignore[method-assign]

    def _let_go_in_child(self) -> None:
        """In a child forked from the capture (``tpudiag.forks``, a DataLoader worker forked inside a window): the
        profiler session it inherited stops recording there.  Not by stopping it: that builds every event of the
        window so far in the child (7.8 s and 2 GB for 200 k events, measured); the record-function callbacks go
        instead, and the events recorded before the fork stay untouched copies of the parent's pages.  A profiler
        session of the child's own neither pauses nor resumes tpudiag's: torch's methods are put back."""
        self._pulse = None
        self._paused_for_user = False
        self._restore_patches()
        if self._prof is not None:
            import torch

            torch._C._autograd._clear_callbacks()  # type: ignore[attr-defined]
            torch.autograd.profiler._is_profiler_enabled = False
        self._prof = None

    def _restore_patches(self) -> None:
        for owner, attr, original in self._patches:
            setattr(owner, attr, original)
        self._patches.clear()

    def _uninstall(self) -> None:
        self._restore_patches()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._tracker is not None:
            self._tracker.remove()

    # -- output -----------------------------------------------------------------------------------------------
    def _write_chunk(self, path: Path) -> None:
        assert self._ctx is not None
        roots = self._root_inputs[self._roots_done :]
        self._roots_done = len(self._root_inputs)
        sources = self._tracker.sources if self._tracker else None
        events, steps = _analyse_chunk(self._ctx, path, self._events_done, self._steps_done, sources, roots)
        self._events_done += events
        self._steps_done += steps

    def _defer_chunk(self, path: Path) -> None:
        assert self._ctx is not None
        job = {
            "path": str(path),
            "first_event_id": self._events_done,
            "first_step": self._steps_done,
            "sources": dict(self._tracker.sources) if self._tracker else None,
            "roots": self._root_inputs[self._roots_done :],
            "profile_memory": self._profile_memory,
        }
        self._roots_done = len(self._root_inputs)
        self._ctx.defer(self, job)


def _analyse_chunk(
    ctx: CaptureContext,
    path: Path,
    first_event_id: int,
    first_step: int,
    sources: dict[str, str] | None,
    roots: list[str | None],
    part: str | None = None,
) -> tuple[int, int]:
    """Analyse one Chrome trace chunk into the spool (trace_events, steps); how many events and steps it held."""
    from tpudiag.traces import kineto, kineto_tables

    trace = kineto.load(path)
    if len(trace) == 0:
        return 0, 0
    tables = kineto_tables.to_tables(
        trace,
        run_id=ctx.run_id,
        first_event_id=first_event_id,
        first_step=first_step,
        whole_fallback=first_step == 0,
        module_sources=sources,
        root_inputs=roots,
    )
    ctx.spool.write_table("trace_events", tables.events, part=part)
    ctx.spool.write_table("steps", kineto_tables.steps_table(tables.steps, ctx.run_id), part=part)
    with internal_errors.current().guard("memory", "analyse a trace window's memory"):
        from tpudiag.collectors import memory_window

        memory_window.spool_window(ctx, path, trace, tables, part=part)
    return len(trace), len(tables.steps)


def analyse_window_extras(ctx: CaptureContext, path: Path, trace: Any, tables: Any, part: str | None) -> None:
    """What a trace window says besides its events (``tpudiag.longrun.analyst.WINDOW_HOOK``): the memory
    collector's allocator view, as ``_analyse_chunk`` does for a chunk."""
    with internal_errors.current().guard("memory", "analyse a trace window's memory"):
        from tpudiag.collectors import memory_window

        memory_window.spool_window(ctx, path, trace, tables, part=part)
