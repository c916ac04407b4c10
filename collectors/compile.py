"""The compile collector: torch's structured trace, received in-process, as compile_events.

A ``logging.Handler`` on ``torch.__trace`` (the logger behind ``torch._logging.trace_structured``) hands every
record to ``CompileEventBuilder``, the interpretation shared with the TORCH_TRACE file reader.  It sees Dynamo
compiles and recompiles (with guard-failure reasons), graph breaks, Inductor/AOTAutograd cache lookups and
failures, and TorchTPU's eager executable-cache events and ``backend="tpu"`` graph artifacts.

TorchTPU only records its eager events when ``TORCH_TRACE`` is set before ``import torch``.  When torch_tpu is
installed and the user did not set TORCH_TRACE, ``prepare`` points it at a folder in the run directory;
``start`` then detaches torch's own file handler (so nothing is written there) and unsets the variable (so
child processes do not inherit it), and ``stop`` removes the folder.  A TORCH_TRACE set by the user is left
alone.
TorchTPU drains its event buffer every 5 s and at exit, so ``stop`` drains it once more before detaching.

Attaching a handler makes torch build the records it would otherwise skip; it does not change what
compiles (the tests compare Dynamo's counters with and without the collector; bench/bench_compile.py measures
the overhead).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

from tpudiag import internal_errors
from tpudiag.analysis.compile_events import CompileEventBuilder
from tpudiag.longrun import control
from tpudiag.model import CompileEvent
from tpudiag.plugins import CaptureContext

TRACE_LOGGER = "torch.__trace"
TRACE_ENV = "TORCH_TRACE"
MAX_ENTRY_STATS = 200


class _Handler(logging.Handler):
    def __init__(self, builder: CompileEventBuilder, sink: list[CompileEvent], lock: threading.Lock) -> None:
        super().__init__(level=logging.DEBUG)
        self._builder, self._sink, self._lock = builder, sink, lock
        self.errors = 0

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None)
        if not isinstance(metadata, dict):
            return
        try:
            with self._lock:
                events = self._builder.feed(metadata, getattr(record, "payload", None), int(record.created * 1e9))
                self._sink += events
            for event in events:  # the pulse counts them; after warm-up a recompile or graph break opens a window
                control.compile_event(event.kind, event.reason or event.function)
        except Exception as err:  # a record we do not understand must never break the user's compile
            self.errors += 1
            internal_errors.current().record("compile", f"trace record {_event_name(metadata)}", err)


def _event_name(metadata: dict[str, Any]) -> str:
    return next((str(k) for k in metadata if k not in ("frame_id", "frame_compile_id", "attempt", "rank")), "?")


def tpu_cache_stats() -> dict[str, Any] | None:
    """``torch.tpu._get_cache_stats()`` as plain values, or None when torch_tpu is not loaded."""
    if "torch_tpu" not in sys.modules:
        return None
    import torch

    tpu = getattr(torch, "tpu", None)
    getter = getattr(tpu, "_get_cache_stats", None)
    if getter is None:
        return None
    try:
        stats = getter()
    except Exception:  # no device / runtime not initialised: no counters, not an error of the run
        return None
    out: dict[str, Any] = {}
    for name in (
        "num_cache_reqs",
        "num_cache_hits",
        "num_compilations",
        "peak_compilation_host_memory_bytes",
    ):
        value = getattr(stats, name, None)
        if isinstance(value, (int, float)):
            out[name] = value
    entries = getattr(stats, "per_entry_stats", None)
    if isinstance(entries, (list, tuple)):
        out["num_entries"] = len(entries)
        out["per_entry_stats"] = [_plain(e) for e in list(entries)[:MAX_ENTRY_STATS]]
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    attrs = {a: getattr(value, a) for a in dir(value) if not a.startswith("_")}
    return {a: _plain(v) for a, v in attrs.items() if not callable(v)}


class CompileCollector:
    name = "compile"
    description = (
        "torch.compile / TorchTPU compilations, cache hits and misses, recompiles with their reasons, graph breaks"
    )
    start_order = 20

    def __init__(self) -> None:
        self._ctx: CaptureContext | None = None
        self._own_trace_dir: Path | None = None
        self._events: list[CompileEvent] = []
        self._lock = threading.Lock()
        self._builder: CompileEventBuilder | None = None
        self._handler: _Handler | None = None
        self._stats_start: dict[str, Any] | None = None

    # -- plugin protocol ------------------------------------------------------------------------------------
    def is_available(self) -> bool:
        return importlib.util.find_spec("torch") is not None

    def prepare(self, ctx: CaptureContext) -> None:
        """Set TORCH_TRACE for TorchTPU's eager events: it must be set before torch (and torch_tpu) load."""
        if os.environ.get(TRACE_ENV):
            ctx.metadata["torch_trace"] = os.environ[TRACE_ENV]
            return
        if importlib.util.find_spec("torch_tpu") is None:
            return
        if "torch" in sys.modules:
            ctx.note(
                "torch was imported before the compile collector could set TORCH_TRACE: TorchTPU eager "
                "cache events are not recorded"
            )
            return
        folder = ctx.run_dir / "compile" / "torch_trace"
        os.environ[TRACE_ENV] = str(folder)
        self._own_trace_dir = folder

    def start(self, ctx: CaptureContext) -> None:
        import torch  # noqa: F401  (sets up torch.__trace)

        self._ctx = ctx
        logger = logging.getLogger(TRACE_LOGGER)
        if self._own_trace_dir is not None:
            # Our TORCH_TRACE only exists to switch TorchTPU's recording on: keep torch from writing files
            # there and keep child processes from inheriting it (TorchTPU read it at import).
            from torch._logging._internal import LazyTraceHandler

            for h in list(logger.handlers):
                if isinstance(h, LazyTraceHandler):
                    logger.removeHandler(h)
            if os.environ.get(TRACE_ENV) == str(self._own_trace_dir):
                del os.environ[TRACE_ENV]
        self._builder = CompileEventBuilder(ctx.run_id)
        self._handler = _Handler(self._builder, self._events, self._lock)
        # First in line: without TORCH_TRACE, torch's LazyTraceHandler removes itself on the first record
        # while logging iterates the handlers, which skips the handler after it for that record.
        logger.addHandler(self._handler)
        logger.handlers.remove(self._handler)
        logger.handlers.insert(0, self._handler)
        if logger.getEffectiveLevel() > logging.DEBUG:
            logger.setLevel(logging.DEBUG)
        self._stats_start = tpu_cache_stats()
        self._record_stats("start", self._stats_start)

    def flush(self) -> None:
        if self._ctx is None:
            return
        with self._lock:
            batch, self._events[:] = list(self._events), []
        self._ctx.spool.write_records(CompileEvent, batch)

    def stop(self) -> None:
        if self._ctx is None or self._builder is None:
            return
        self._drain_torch_tpu()
        stats_end = tpu_cache_stats()
        self._record_stats("end", stats_end)
        logger = logging.getLogger(TRACE_LOGGER)
        if self._handler is not None:
            logger.removeHandler(self._handler)
            if self._handler.errors:
                self._ctx.note(
                    f"compile collector skipped {self._handler.errors} structured-trace record(s) it could not read"
                )
        with self._lock:
            self._events += self._builder.finish()
        self.flush()
        self._remove_own_trace_dir()

    # -- helpers --------------------------------------------------------------------------------------------
    def _drain_torch_tpu(self) -> None:
        """TorchTPU's daemon drains every 5 s; drain now so the last events of the run are not lost."""
        tracing = sys.modules.get("torch_tpu._internal.tracing")
        flush = getattr(tracing, "_flush", None)
        if callable(flush):
            with contextlib.suppress(Exception):
                flush()

    def _record_stats(self, when: str, stats: dict[str, Any] | None) -> None:
        if stats is None or self._builder is None or self._ctx is None:
            return
        event = CompileEvent(
            # Negative seq: the Dynamo/TorchTPU events keep the numbering a TORCH_TRACE import gives them.
            run_id=self._ctx.run_id,
            seq=-1 if when == "start" else -2,
            kind="tpu_stats",
            ts_ns=int(self._ctx.clock.wall() * 1e9),
            cache_tier="tpu_executable",
            reason=when,
            payload=json.dumps(stats, default=str),
        )
        with self._lock:
            self._events.append(event)

    def _remove_own_trace_dir(self) -> None:
        folder = self._own_trace_dir
        if folder is None:
            return
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # only if empty
