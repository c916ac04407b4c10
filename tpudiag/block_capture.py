"""The in-process driver: a block of code in this process under the capture session (``tpudiag.capture``, the
notebook magic and the pytest plugin all go through it; ``tpudiag capture`` runs whole scripts).

    block = BlockCapture(store, "train")
    block.start()
    try:
        ...                        # the user's code, unchanged
    except BaseException as exc:
        block.stop(exc)            # stored as failed (or interrupted), the error in its notes; the caller re-raises
        raise
    block.stop(None)

What differs from a script: no runpy (the code is the caller's), the run is stored before ``stop`` returns
(``sinks.StoreNow``: a notebook reads it at once), and the outcome comes from the exception the block raised.
DuckDB is not opened before the block: the run is registered at the first flush or by the final store write.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from tpudiag import forks, runner
from tpudiag.clock import Clock, SystemClock
from tpudiag.model import Run
from tpudiag.plugins import load_collectors
from tpudiag.run_setup import RunStart, prepare_run
from tpudiag.session import CaptureSession, Delivered
from tpudiag.sinks import StoreNow
from tpudiag.spool import Spool
from tpudiag.store import Store


def outcome_of(exc: BaseException | None) -> runner.Outcome:
    """How a block ended, as a script's outcome: its exception (None: it returned) as status and exit code."""
    if exc is None:
        return runner.Outcome(0, "ok")
    if isinstance(exc, KeyboardInterrupt):
        return runner.Outcome(130, "interrupted", "KeyboardInterrupt")
    if isinstance(exc, SystemExit):
        code = runner._exit_code_of(exc)
        return runner.Outcome(code, "ok" if code == 0 else "failed", None if code == 0 else f"SystemExit({exc.code!r})")
    return runner.Outcome(1, "failed", f"{type(exc).__name__}: {exc}")


class BlockCapture:
    def __init__(
        self,
        store: Store,
        name: str,
        collect: list[str] | None = None,
        options: dict[str, Any] | None = None,
        script: str | None = None,
        clock: Clock | None = None,
        flush_s: float = 10.0,
    ) -> None:
        self.store, self.name = store, name
        self.clock = clock or SystemClock()
        self._collect, self._options, self._script, self._flush_s = collect, dict(options or {}), script, flush_s
        self.session: CaptureSession | None = None
        self.delivered: Delivered | None = None

    @property
    def run_id(self) -> str:
        assert self.session is not None, "start() first"
        return self.session.run.id

    @property
    def finished(self) -> bool:
        return self.delivered is not None

    @property
    def notes(self) -> list[str]:
        return self.session.ctx.notes if self.session is not None else []

    def start(self) -> None:
        """Collectors started around what follows; raises only for bad options (unknown collector, bad store)."""
        with runner.signals_to_main_thread():
            self.store.check_file()
            collectors = load_collectors(self._collect)
            start = RunStart(self.name, self._script or self.name, (), Path.cwd())
            run, run_dir = prepare_run(self.store, self.clock, start, collectors)
            self.session = CaptureSession(
                run, run_dir, Spool(run_dir / "spool"), collectors, StoreNow(self.store),
                options=self._options, clock=self.clock, flush_s=self._flush_s, ended_with="block",
            )  # fmt: skip
            self.session.start()

    def stop(self, exc: BaseException | None) -> Run:
        """Stop collecting and store the run (idempotent); the stored record."""
        assert self.session is not None, "start() first"
        if forks.in_child():  # a child forked inside the block, leaving it: nothing is stored from here
            return self.session.run
        if self.delivered is None:
            if exc is not None and not isinstance(exc, (KeyboardInterrupt, SystemExit)):
                runner.tell_failure(exc)  # e.g. the memory collector reads an out-of-memory error
            self.delivered = self.session.deliver(self.session.stop(outcome_of(exc)))
            sys.stderr.flush()
        return self.delivered.run
