"""The trace collector's long-run part (issue 21): the pulse, the window plan carried out at step boundaries, the
manual trigger's poll, and the hand-off of each finished window to the analysis process.

Everything here runs inside the user's step hooks: whatever goes wrong is recorded and degrades the capture (no
more windows, or no more pulse), never the script.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from tpudiag import internal_errors, processes, runner
from tpudiag.longrun import analyst, collection, control, heap, manual
from tpudiag.plugins import CaptureContext

WINDOW_TRIM_S = 0.1  # the least time between two trims at a window's step boundaries (``_boundary``)

NO_EVENTS = "the trace collector recorded no events"
# How long ``stop`` waits for the analysis process to finish its queue before leaving the rest to the deferred
# finish (which runs after the script's exit status is known) or doing it itself.
WORKER_WAIT_S = 1.0


class LongRunMixin:
    """Mixed into TraceCollector (which owns the profiler sessions); see collectors/trace.py."""

    _ctx: CaptureContext | None
    _prof: Any
    _pulse: Any
    _plan: Any
    _poller: Any
    _worker: Any
    _window_jobs: dict[int, dict[str, Any]]
    _root_inputs: list[str | None]
    _tracker: Any
    _trace_dir: Path
    _tpu: Any
    _step_ended: bool
    _settler: collection.Settler

    name: str

    def _start_session(self) -> None: ...
    def _stop_session(self, analyse: bool = True) -> None: ...

    # -- start ------------------------------------------------------------------------------------------------
    def _prepare_long_run(self, ctx: CaptureContext) -> None:
        """Before torch loads: the window analyst starts, and imports what a window's job needs while the capture
        imports torch and the script starts (``processes.early_start``)."""
        if str(ctx.options.get("trace") or "windows") == "all":
            return
        trace_dir = ctx.run_dir / "trace"
        trace_dir.mkdir(parents=True, exist_ok=True)
        self._worker = analyst.Worker(ctx.run_id, ctx.run_dir, trace_dir)
        self._worker.start()

    def _start_long_run(self, ctx: CaptureContext) -> None:
        from tpudiag.collectors.pulse import PulseRecorder

        mode = str(ctx.options.get("trace") or "windows")
        rank = ctx.options.get("rank") or os.environ.get("RANK") or 0
        self._pulse = PulseRecorder(ctx, rank=int(rank) if str(rank).isdigit() else 0)
        if mode == "all":
            return
        from tpudiag.collectors.windows import WindowPlan
        from tpudiag.longrun import schedule, triggers

        sched = schedule.parse(
            ctx.options.get("trace_schedule"),
            first_steps=int(ctx.options.get("first_steps") or schedule.FIRST_STEPS),
            first_s=float(ctx.options.get("first_s") or schedule.FIRST_S),
        )
        cap = analyst.DiskCap(analyst.parse_size(ctx.options["max_disk"])) if ctx.options.get("max_disk") else None
        interval = ctx.options.get("trigger_interval_s") or os.environ.get("TPUDIAG_TRIGGER_INTERVAL_S")
        limit = triggers.RateLimit(float(interval or triggers.MIN_INTERVAL_S))
        self._plan = WindowPlan(
            sched, cap or analyst.DiskCap(), limit, int(ctx.options.get("trigger_steps") or 5), time.monotonic()
        )
        self._plan.open.start_ns = time.time_ns()
        self._pulse.window_id = 0
        self._poller = manual.Poller(manual.trigger_folders(ctx.run_dir), time.monotonic())
        if self._worker is None:  # (``_prepare_long_run`` started it, unless that failed)
            self._worker = analyst.Worker(ctx.run_id, ctx.run_dir, ctx.run_dir / "trace")
        pulse = self._pulse
        pulse.plan, pulse.poller, pulse.after = self._plan, self._poller, self._plan_step
        self._settler = collection.Settler()
        control.activate()

    @property
    def _window_number(self) -> int:
        return int(self._plan.open.window_id) if self._plan is not None and self._plan.open is not None else 0

    # -- every step (training thread) -------------------------------------------------------------------------
    def _plan_step(self, fired: list[tuple[str, str]] | tuple[()], now: float) -> None:
        """The pulse's ``after``: a step ended that the plan must see (a trigger fired, a request came, the manual
        trigger's poll or the schedule is due).  ``now``: monotonic seconds at the step's end."""
        pulse, plan = self._pulse, self._plan
        try:
            if now >= self._poller.next_s:
                for req in self._poller.poll(now):
                    steps = req.get("steps")
                    control.request(
                        "manual",
                        steps=int(steps) if steps else None,
                        numerics=req.get("numerics") == "all",
                        detail="tpudiag trigger",
                    )
            severity = {"slow_step": pulse.slow_ratio} if fired and pulse.slow_ratio else None
            plan.plan(pulse.step, now, list(fired), self._busy, severity)
        except Exception as err:
            internal_errors.current().record("trace", "window plan", err)

    def _busy(self) -> set[int]:
        return {int(p.stem.split("-")[1]) for p in analyst.pending_jobs(self._trace_dir)}

    def _boundary(self) -> None:
        """At the first root forward after a step: close and open windows as planned."""
        plan, pulse = self._plan, self._pulse
        t0 = time.perf_counter_ns()
        processes.end_early_start()  # (the first step boundary: no step runs beside a child at its priority)
        closing = None
        if plan.close_next:
            closing = plan.open.window_id if plan.open is not None else None
            self._close_window()
        if plan.next is not None and plan.disabled is None:
            self._open_window()
        # The step that closes a window pays for its export: it is counted as part of that window.
        pulse.window_id = plan.open.window_id if plan.open is not None else closing
        control.set_window_open(pulse.window_id is not None)
        if plan.open is not None and plan.open.reason != "first_steps":
            # Inside a window the heap keeps what each step freed: the profiler's own allocations land between the
            # step's large blocks, so glibc can neither reuse them whole nor give them back, and a step that
            # allocates large blocks grows the heap by about its own size every step (the long-run bench's 24 MB
            # sort: +130 MB over a 5-step window).  Free pages go back at each step of a window instead (at most
            # every WINDOW_TRIM_S: a window of fast steps pays one or two trims, a few ms each).  Not in the first
            # window: a short script runs inside it from start to end, with its imports' and warm-up's frees.
            heap.release(min_interval_s=WINDOW_TRIM_S, caller="window step")
        pulse.add_own(time.perf_counter_ns() - t0)

    def _open_window(self) -> None:
        assert self._ctx is not None
        window = self._plan.opened()
        if window is None or self._prof is not None:
            return
        try:
            with runner.signals_to_main_thread():
                self._start_session()
            window.start_ns = time.time_ns()
            self._root_inputs.clear()
        except Exception as err:
            self._plan.open = None
            self._degrade(f"the profiler failed to start ({err})")

    def _close_window(self, kick: bool = True, settle: bool = True) -> dict[str, Any] | None:
        """Stop the open window's session, export its trace and leave its job for the analysis process; with
        ``kick``, free its results and run the full garbage collection that is due (``longrun/collection.py``): the
        step that closes a window is counted as part of it."""
        assert self._ctx is not None
        plan = self._plan
        step = self._pulse.step
        if self._prof is None:
            plan.closed(step, time.monotonic())
            return None
        window = plan.open
        try:
            self._stop_session(analyse=False)
            path = self._trace_dir / f"kineto-{window.window_id:03d}.json"
            if not path.exists() or path.stat().st_size == 0:
                raise OSError(f"the profiler wrote no trace file at {path}")
        except Exception as err:
            plan.closed(step, time.monotonic())
            self._degrade(f"a trace window could not be written ({err})")
            return None
        plan.closed(step, time.monotonic())
        job = {
            "window_id": window.window_id,
            "reason": window.reason,
            "detail": window.detail,
            "numerics": window.numerics,
            "first_step": window.first_step,
            "last_step": max(step - 1, window.first_step),
            "start_ns": window.start_ns,
            "end_ns": time.time_ns(),
            "path": str(path),
            "first_event_id": analyst.first_event_id(window.window_id),
            "sources": dict(self._tracker.sources) if self._tracker else None,
            "roots": list(self._root_inputs),
            "rank": self._pulse.rank,
            "run_dir": str(self._ctx.run_dir),
            "profile_memory": bool(getattr(self, "_profile_memory", False)),
        }
        self._root_inputs.clear()
        try:
            analyst.write_job(self._trace_dir, job)
            plan.cap.add(window.window_id, window.reason, path)
        except OSError as err:
            self._degrade(f"a trace window could not be written ({err})")
            return None
        self._window_jobs[window.window_id] = {k: v for k, v in job.items() if k not in ("sources", "roots")}
        if kick:
            self._release_session()
            if settle:
                try:
                    self._settler.settle(first=window.reason == "first_steps")
                except Exception as err:
                    internal_errors.current().record("trace", "garbage collection", err)
            heap.release()
            self._worker.kick()
        return job

    def _release_session(self) -> None:
        """Free a closed window's profiler results now: the profile objects sit in a reference cycle that only a
        full garbage collection frees, so each window kept ~10 MB until one ran (RSS grew with the run)."""
        old: Any = getattr(self, "profiler", None)
        inner = getattr(old, "profiler", None)
        if inner is not None:
            with contextlib.suppress(Exception):
                inner.kineto_results = None
                old.profiler = None

    def _pause_window(self) -> None:
        """The script starts a profiler session of its own: the open window ends here (its part is kept)."""
        self._paused = self._plan.open
        self._close_window(settle=False)  # inside the script's own profiler start: no collection of tpudiag's

    def _resume_window(self) -> None:
        """... and the rest of that window opens again as a new window once the script's session is over."""
        paused, self._paused = getattr(self, "_paused", None), None
        plan = self._plan
        if paused is None or plan.open is not None or plan.disabled is not None:
            return
        from tpudiag.collectors.windows import Window

        plan.next = Window(
            plan.count, paused.reason, self._pulse.step, paused.end_step, paused.deadline_s, paused.numerics,
            paused.detail, opened_s=paused.opened_s,
        )  # fmt: skip
        self._open_window()

    def _degrade(self, why: str) -> None:
        assert self._ctx is not None
        if self._plan.disabled is None:
            self._plan.disabled = why
            self._ctx.note(f"trace windows stopped: {why}; the script and the pulse went on")

    # -- stop -------------------------------------------------------------------------------------------------
    def _stop_windows(self, deferred: bool) -> None:
        assert self._ctx is not None
        control.deactivate()
        plan = self._plan
        if plan.open is not None:
            job = self._close_window(kick=False)
            # A script that ended inside its first window: analysed exactly as a whole-run trace (here, or by the
            # deferred finish).
            if job is not None and not deferred and job["window_id"] == 0:
                with contextlib.suppress(FileNotFoundError):
                    job_path = self._trace_dir / analyst.JOBS / "window-0000.json"
                    if analyst.run_job(self._ctx.run_id, self._ctx.spool, job_path, analyst.WINDOW_HOOK) == 0:
                        self._ctx.note(NO_EVENTS)
        self._worker.stop(WORKER_WAIT_S if deferred else 600.0)
        if analyst.pending_jobs(self._trace_dir):
            job = {"windows": True, "trace_dir": str(self._trace_dir)}
            if not (deferred and self._ctx.defer(self, job)):
                analyst.run_pending(self._ctx.run_id, self._ctx.spool, self._trace_dir)
        analyst.tidy(self._trace_dir)
        self._write_pruned()
        held = plan.limit.held
        if held:
            what = ", ".join(f"{n} {r}" for r, n in sorted(held.items()))
            self._ctx.note(f"trace windows: triggers held back by the rate limit: {what}")
        if plan.refused:
            what = ", ".join(f"{n} {r}" for r, n in sorted(plan.refused.items()))
            self._ctx.note(f"trace windows: --max-disk kept {what} window(s) from opening")
        self._ctx.metadata["trace_windows"] = {"windows": plan.count, "pruned": list(plan.cap.pruned)}

    def _write_pruned(self) -> None:
        assert self._ctx is not None
        pruned = [self._window_jobs[w] for w in self._plan.cap.pruned if w in self._window_jobs]
        if not pruned:
            return
        from tpudiag.model import TraceWindow, records_to_arrow

        rows = [
            TraceWindow(
                run_id=self._ctx.run_id,
                window_id=int(j["window_id"]),
                reason=str(j["reason"]),
                first_step=j["first_step"],
                last_step=j["last_step"],
                start_ns=int(j["start_ns"]),
                end_ns=int(j["end_ns"]),
                first_event_id=int(j["first_event_id"]),
                rank=int(j["rank"]),
                detail=j["detail"],
                numerics=bool(j["numerics"]),
                path=None,
                pruned=True,
            )
            for j in pruned
        ]
        with contextlib.suppress(Exception):
            self._ctx.spool.write_table(TraceWindow.TABLE, records_to_arrow(TraceWindow, rows), part="pruned")

    def _stop_pulse(self) -> None:
        if self._pulse is None or self._ctx is None:
            return
        try:
            pulse = self._pulse
            if pulse.roots.by_root and pulse.started_ns is not None:
                # The step of the script's last root call (collectors/root_steps.py) ends with the script: recorded,
                # the window plan left out (its windows are closed).
                pulse.plan = None
                pulse.step_end(None)
            pulse.stop()
        except Exception as err:
            internal_errors.current().record("pulse", "stop", err)
        pulse = self._pulse
        if pulse.nonfinite_steps:
            self._ctx.note(f"pulse: {pulse.nonfinite_steps} step(s) had a non-finite gradient")
        stalls = pulse.stall_clock
        if stalls.stalls:
            self._ctx.note(
                f"pulse: {stalls.stalls} slow step(s) were the machine's, not the script's (their thread was kept off "
                f"its CPU {stalls.stalled_ns / 1e6:.0f} ms in all: another task on its core, or the VM's CPU taken): "
                "no slow_step window opened for them"
            )
