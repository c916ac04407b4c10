"""The trace collector for CPU and CUDA: torch.profiler (Kineto) around the whole script.

- shapes recorded; CUDA activity added when CUDA is available;
- every ``nn.Module`` forward is wrapped in a ``module::<path>`` range so ops carry their module path;
- the root module's input shapes are remembered per call, so steps can be tied to the input sizes that ran;
- a profiler session started by the script itself would crash Kineto if ours kept running (a nested session
  segfaults on torch 2.13), so ours pauses while the script's runs and resumes afterwards, and the run says so.

Each profiler session becomes one Chrome trace file kept in the run folder (``trace/kineto-NNN.json``); at the end
they are analysed together (nesting, self time, modules, steps) and spooled as trace_events and steps.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

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


class TraceCollector:
    name = "trace"

    def __init__(self) -> None:
        self._ctx: CaptureContext | None = None
        self._prof: Any = None
        self._own_inner: Any = None
        self._starting = False
        self._paused_for_user = False
        self._user_sessions = 0
        self._chunks: list[Path] = []
        self._tracker: Any = None
        self._root_inputs: list[str | None] = []
        self._patches: list[tuple[Any, str, Any]] = []
        self.profiler: Any = None  # the last torch.profiler.profile object (tests read key_averages from it)

    # -- plugin protocol --------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        import importlib.util

        return importlib.util.find_spec("torch") is not None

    def prepare(self, ctx: CaptureContext) -> None:
        """Nothing to set before torch loads."""

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
        record_function = torch.autograd.profiler.record_function
        root_inputs = self._root_inputs

        def on_enter(path: str, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], is_root: bool) -> Any:
            if is_root:
                root_inputs.append(input_shapes(args, kwargs))
            rf = record_function("module::" + path)
            rf.__enter__()
            return rf

        def on_exit(path: str, token: Any) -> None:
            if token is not None:
                token.__exit__(None, None, None)

        self._tracker = ModuleTracker(on_enter, on_exit)
        self._tracker.install()
        self._patch_user_sessions()
        self._start_session()

    def flush(self) -> None:
        """Traces are written per profiler session; nothing to do between sessions."""

    def stop(self) -> None:
        if self._ctx is None:
            return
        try:
            self._stop_session()
        finally:
            self._unpatch()
            if self._tracker is not None:
                self._tracker.remove()
        if self._user_sessions:
            self._ctx.note(
                f"the script ran its own torch.profiler session {self._user_sessions} time(s); tpudiag's trace "
                "paused during it (its events are in the script's own trace)"
            )
        self._write_tables()

    # -- profiler sessions ------------------------------------------------------------------------------------
    def _start_session(self) -> None:
        import torch

        self._starting = True
        try:
            prof = torch.profiler.profile(
                activities=self._activities, record_shapes=True, with_stack=self._with_stack
            )
            _quiet_stderr(prof.start)
        finally:
            self._starting = False
        self._prof = prof
        self._own_inner = getattr(prof, "profiler", None)
        self.profiler = prof

    def _stop_session(self) -> None:
        import torch

        prof, self._prof = self._prof, None
        if prof is None:
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()  # pending device work lands in the trace
        _quiet_stderr(prof.stop)
        path = self._trace_dir / f"kineto-{len(self._chunks):03d}.json"
        prof.export_chrome_trace(str(path))
        self._chunks.append(path)

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
                collector._stop_session()
            return orig_prepare(prof_self)

        def __exit__(prof_self: Any, *exc: Any) -> Any:
            result = orig_exit(prof_self, *exc)
            if collector._paused_for_user and prof_self is not collector._own_inner:
                collector._paused_for_user = False
                collector._start_session()
            return result

        self._patches = [(cls, "_prepare_trace", orig_prepare), (cls, "__exit__", orig_exit)]
        cls._prepare_trace = _prepare_trace
        cls.__exit__ = __exit__

    def _unpatch(self) -> None:
        for owner, attr, original in self._patches:
            setattr(owner, attr, original)
        self._patches.clear()

    # -- output -----------------------------------------------------------------------------------------------
    def _write_tables(self) -> None:
        from tpudiag.traces import kineto

        assert self._ctx is not None
        merged: kineto.KinetoTrace | None = None
        for chunk in self._chunks:
            part = kineto.load(chunk)
            if merged is None:
                merged = part
                continue
            for attr in ("process", "thread", "name", "category", "start_ns", "dur_ns", "args"):
                getattr(merged, attr).extend(getattr(part, attr))
            merged.process_names.update(part.process_names)
            merged.thread_names.update(part.thread_names)
        if merged is None or len(merged) == 0:
            self._ctx.note("the trace collector recorded no events")
            return
        tables = kineto.to_tables(
            merged,
            run_id=self._ctx.run_id,
            module_sources=self._tracker.sources if self._tracker else None,
            root_inputs=self._root_inputs,
        )
        self._ctx.spool.write_table("trace_events", tables.events)
        self._ctx.spool.write_table("steps", kineto.steps_table(tables.steps, self._ctx.run_id))
        self._ctx.metadata["trace_files"] = [str(p) for p in self._chunks]
