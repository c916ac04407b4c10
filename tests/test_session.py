"""The capture session's sequence, seen by a sink and collectors of the test's own (the extension points a remote
sink or a new collector builds on): start order, flushes, reverse stop, deferred jobs, the one final record."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tpudiag import internal_errors
from tpudiag.clock import FakeClock
from tpudiag.model import Run
from tpudiag.plugins import CaptureContext
from tpudiag.runner import Outcome
from tpudiag.session import CaptureSession, Delivered, Finished
from tpudiag.spool import Spool


class Recorder:
    def __init__(self, name: str, calls: list[str], fail_stop: bool = False, defer: bool = False) -> None:
        self.name, self.calls, self.fail_stop, self.defer = name, calls, fail_stop, defer
        self.ctx: CaptureContext | None = None

    def is_available(self) -> bool:
        return True

    def prepare(self, ctx: CaptureContext) -> None:
        self.calls.append(f"prepare {self.name}")

    def start(self, ctx: CaptureContext) -> None:
        self.ctx = ctx
        self.calls.append(f"start {self.name}")

    def flush(self) -> None:
        self.calls.append(f"flush {self.name}")

    def stop(self) -> None:
        self.calls.append(f"stop {self.name}")
        assert self.ctx is not None
        if self.defer and not self.ctx.defer(self, {"chunk": 7}):
            self.calls.append(f"inline {self.name}")
        if self.fail_stop:
            raise RuntimeError("disk full")

    def finish(self, ctx: CaptureContext, args: dict[str, Any]) -> None:
        self.calls.append(f"finish {args}")


class ListSink:
    """A sink of the test's own: what a remote store implements."""

    def __init__(self, calls: list[str], defers: bool) -> None:
        self.calls, self._defers = calls, defers
        self.finished: Finished | None = None

    @property
    def defers(self) -> bool:
        return self._defers

    def begin(self, run: Run) -> None:
        self.calls.append(f"begin {run.status}")

    def flush(self) -> None:
        self.calls.append("sink flush")

    def deliver(self, finished: Finished) -> Delivered:
        self.finished = finished
        return Delivered(finished.run, stored=False, notes=("uploaded later",))


def _session(tmp_path: Path, defers: bool, flush_s: float = 3600.0) -> tuple[CaptureSession, ListSink, list[str]]:
    calls: list[str] = []
    clock = FakeClock(start=1_700_000_000.0)
    run = Run(id="r1", name="t", status="running", started_at=clock.wall(), artifacts_dir=str(tmp_path))
    collectors: list[Any] = [Recorder("a", calls), Recorder("b", calls, fail_stop=True, defer=True)]
    sink = ListSink(calls, defers)
    session = CaptureSession(
        run, tmp_path, Spool(tmp_path / "spool"), collectors, sink, clock=clock, flush_s=flush_s, ended_with="block"
    )
    return session, sink, calls


def test_the_sequence_and_the_final_record(tmp_path: Path) -> None:
    session, sink, calls = _session(tmp_path, defers=True)
    session.start()
    assert isinstance(session.clock, FakeClock)
    session.clock.advance(2.5)
    internal_errors.current().record("b", "a hook", ValueError("oops"))
    finished = session.stop(Outcome(1, "failed", "ValueError: boom"))
    delivered = session.deliver(finished)
    # The sink begins first (a store's feeder child imports while the collectors import torch: sinks.py).
    assert calls == ["begin running", "prepare a", "prepare b", "start a", "start b", "stop b", "stop a"]
    run = finished.run
    assert (run.status, run.exit_code, run.duration_s) == ("failed", 1, 2.5)  # the duration is the clock's
    assert run.notes[0].startswith("internal errors: 1 internal error (b: ValueError in a hook)")
    assert "collector b failed while stopping: disk full" in run.notes
    assert run.notes[-1] == "block ended with ValueError: boom"
    assert isinstance(run.precision, dict)
    assert [(j.collector, j.factory, j.args) for j in finished.jobs] == [("b", f"{__name__}:Recorder", {"chunk": 7})]
    assert sink.finished is finished and delivered.notes == ("uploaded later",)


def test_a_sink_that_stores_now_gets_no_jobs_and_flushes_follow_the_collectors(tmp_path: Path) -> None:
    session, _sink, calls = _session(tmp_path, defers=False, flush_s=0.05)
    session.start()
    deadline = time.monotonic() + 30
    while "sink flush" not in calls and time.monotonic() < deadline:
        time.sleep(0.05)
    finished = session.stop(Outcome(0, "ok"))
    first = calls.index("sink flush")
    assert calls[first - 2 : first] == ["flush a", "flush b"]  # the collectors' parts first, then the sink loads
    assert finished.jobs == () and "inline b" in calls  # told it cannot defer: the work is done in stop
    assert calls[-3:] == ["stop b", "inline b", "stop a"]
    assert not [n for n in finished.run.notes if n.startswith("block ended")]  # it ended without an error
