"""The capture session: the one sequence every way of capturing follows.

    session = CaptureSession(run, run_dir, spool, collectors, sink, clock=clock)
    session.start()                  # errors file, collectors prepared and started, sink.begin, the flusher
    outcome = <run the user's code>  # a script (script_capture), a block (block_capture), a rank (distributed)
    finished = session.stop(outcome) # flusher stopped, parts stopped in reverse, the final record
    delivered = session.deliver(finished)  # handed to the sink chosen up front

The drivers only say what differs: how the run is named and registered, what runs, and which ``Sink`` receives the
finished run (``tpudiag.sinks``: store now, store later in a detached child; ``distributed.session``: rank shards).
Extension points:

- a new destination for runs is a ``Sink`` (see ``tpudiag.sinks``);
- something besides the collectors that must flush with them and stop before them (the distributed probe) is
  ``attach``-ed: anything with ``name``, ``flush()`` and ``stop()``;
- collectors leave deferred work with ``ctx.defer`` (``tpudiag.plugins``); ``Finished.jobs`` carries it to the sink.

Nothing here raises into the user's code: a collector failing to start or stop is a note on the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tpudiag import environment, forks, internal_errors
from tpudiag.cadence import settling_interval
from tpudiag.clock import Clock, SystemClock
from tpudiag.model import Run
from tpudiag.plugins import CaptureContext, Collector, DeferredJob
from tpudiag.run_setup import start_collectors
from tpudiag.runner import Outcome
from tpudiag.spool import Spool


class Part(Protocol):
    """What the session flushes with the collectors and stops before them (in reverse order of attaching)."""

    name: str

    def flush(self) -> None: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Finished:
    """A run whose code has ended: its final record, how its code ended, and the collectors' deferred jobs."""

    run: Run
    outcome: Outcome
    jobs: tuple[DeferredJob, ...] = ()
    context: CaptureContext | None = None


@dataclass(frozen=True)
class Delivered:
    """What the sink made of it: the run as stored (or as it will be), and whether it is in the store now."""

    run: Run
    stored: bool
    notes: tuple[str, ...] = field(default_factory=tuple)


class Sink(Protocol):
    """Where a finished run goes, chosen once before the session starts.  Implementations: ``sinks.StoreNow``,
    ``sinks.StoreLater``, ``distributed.session.ShardSink``, ``distributed.launch.JobSink``."""

    @property
    def defers(self) -> bool:
        """Collectors may leave work for later (``ctx.defer``): asked once, just before they stop."""
        ...

    def begin(self, run: Run) -> None:
        """The run exists (its record has status ``running``); a store may register it now or at a flush."""
        ...

    def flush(self) -> None:
        """Periodically while the code runs, on the flusher thread, after the collectors flushed."""
        ...

    def deliver(self, finished: Finished) -> Delivered:
        """Store (or hand off) the finished run; raises only the store's own errors (``TpudiagError``)."""
        ...


class _Flusher(threading.Thread):
    def __init__(self, parts: Callable[[], list[Any]], sink: Sink, interval: float) -> None:
        super().__init__(name="tpudiag-flusher", daemon=True)
        self._parts, self._sink, self._interval = parts, sink, interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        from tpudiag.longrun import control

        started = time.monotonic()
        while not self._stop_event.wait(settling_interval(self._interval, time.monotonic() - started)):
            with control.background_work():  # the pulse does not judge the script's steps by the GIL it holds
                for part in self._parts():
                    with contextlib.suppress(Exception):
                        part.flush()
                with contextlib.suppress(Exception):
                    self._sink.flush()

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=30)


class CaptureSession:
    def __init__(
        self,
        run: Run,
        run_dir: Path,
        spool: Spool,
        collectors: list[Collector],
        sink: Sink,
        *,
        options: dict[str, Any] | None = None,
        clock: Clock | None = None,
        flush_s: float = 10.0,
        ended_with: str = "script",
    ) -> None:
        self.run, self.run_dir, self.spool, self.sink = run, run_dir, spool, sink
        self.clock = clock or SystemClock()
        self.collectors = collectors
        self.ctx = CaptureContext(
            run_id=run.id, run_dir=run_dir, spool=spool, options=dict(options or {}), clock=self.clock
        )
        self.active: list[Collector] = []
        self.parts: list[Part] = []
        self._flush_s = flush_s
        self._ended_with = ended_with  # the final record's note says "<it> ended with <error>"
        self._flusher: _Flusher | None = None
        self._errors = internal_errors.current()
        self._t0 = 0.0

    def note(self, text: str) -> None:
        self.ctx.note(text)

    def start(self, flusher: bool = True) -> None:
        """Errors file, ``sink.begin``, collectors prepared and started (failures are notes), the flusher.  The sink
        begins first: a store's feeder child then imports while the collectors import torch."""
        self._errors = internal_errors.begin(self.run_dir)
        forks.begin()
        self.sink.begin(self.run)
        self.active = start_collectors(self.collectors, self.ctx)
        if flusher:
            self._flusher = _Flusher(lambda: [*self.active, *self.parts], self.sink, self._flush_s)
            self._flusher.start()
        self._t0 = self.clock.monotonic()

    def attach(self, part: Part) -> None:
        self.parts.append(part)

    def stop(self, outcome: Outcome) -> Finished:
        """The flusher stopped, attached parts then collectors stopped in reverse, the final record built."""
        duration = self.clock.monotonic() - self._t0
        if self._flusher is not None:
            self._flusher.stop()
        self.ctx.can_defer = self.sink.defers
        for part in [*reversed(self.parts), *reversed(self.active)]:
            try:
                part.stop()
            except Exception as err:
                self.ctx.note(f"collector {part.name} failed while stopping: {err}")
        forked = forks.end()
        if forked:
            self.ctx.note(
                f"{forked} child process(es) forked from the script (DataLoader workers, multiprocessing, os.fork) "
                "ran without the capture: their work is not in this run"
            )
        return Finished(self.final_record(outcome, duration), outcome, tuple(self.ctx.jobs), self.ctx)

    def deliver(self, finished: Finished) -> Delivered:
        return self.sink.deliver(finished)

    def final_record(self, outcome: Outcome, duration: float) -> Run:
        kind, device_name = environment.device()
        errors_line = self._errors.closing_line()
        return dataclasses.replace(
            self.run,
            status=outcome.status,
            exit_code=outcome.exit_code,
            duration_s=round(duration, 6),
            torch_version=environment.torch_version(),
            device_kind=kind,
            device_name=device_name,
            precision={**environment.precision(), **self.ctx.metadata.get("precision", {})},
            notes=([f"{internal_errors.NOTE_PREFIX} {errors_line}"] if errors_line else [])
            + list(self.ctx.notes)
            + ([f"{self._ended_with} ended with {outcome.error}"] if outcome.error else []),
        )

    @property
    def internal_errors_line(self) -> str | None:
        return self._errors.closing_line()
