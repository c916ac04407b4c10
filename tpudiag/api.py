"""The public Python API: capture a block of code, or every call of a function, in this process.

    import tpudiag

    with tpudiag.capture(name="train", collect="trace,numerics") as run:
        train(model, data)
    run.id, run.status           # stored before the block returns
    run.report()                 # the dict of ``tpudiag report --json``

    @tpudiag.capture(name="step")  # or bare: @tpudiag.capture
    def step(batch): ...

It is the capture session of ``tpudiag capture`` (same collectors, same guarantee that the code inside behaves as
without it, same run in the store), driven by ``block_capture.BlockCapture``.  The block's exception propagates
unchanged; its run is stored as ``failed`` (``interrupted`` for Ctrl-C) with the error in its notes.  A capture
begun while another is active in this process (nested, or a decorated function called inside a ``with``) joins the
outer run instead of starting a second profiler: its handle names the outer run and a note on that run says so.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar, overload

from tpudiag.block_capture import BlockCapture
from tpudiag.errors import TpudiagError, UsageError
from tpudiag.model import Run
from tpudiag.plugins import check_names
from tpudiag.store import Store, resolve_db_path
from tpudiag.store_access import open_store

F = TypeVar("F", bound=Callable[..., Any])
_lock = threading.Lock()
_active: BlockCapture | None = None  # the capture in progress in this process (collectors are process-wide)


def _collect_list(collect: str | Sequence[str] | None) -> list[str] | None:
    if collect is None:
        return None
    names = [c.strip() for c in (collect.split(",") if isinstance(collect, str) else collect) if c.strip()]
    return [] if names == ["none"] else names


def capture_options(numerics: str | int | None, budget: float | None) -> dict[str, Any]:
    """The collectors' options of the capture command, from the API's arguments (checked as the CLI checks them)."""
    from tpudiag.numerics_options import budget_percent, numerics_mode

    options: dict[str, Any] = {"with_stack": False}
    if numerics is not None:
        numerics_mode(str(numerics))
        options["numerics"] = str(numerics).strip().lower()
    if budget is not None:
        options["budget"] = budget_percent(str(budget))
    return options


class CapturedRun:
    """A run captured by ``tpudiag.capture``: ``id``, and once the block has ended its record and report."""

    def __init__(self, store: Store, run_id: str, joined: bool = False) -> None:
        self.store, self.id = store, run_id
        self.joined = joined  # a nested capture: this is the outer capture's run
        self.record: Run | None = None  # the final record, once stored

    @property
    def status(self) -> str:
        return self.record.status if self.record is not None else "running"

    @property
    def error(self) -> str | None:
        """The exception the block ended with (``"ValueError: ..."``), or None."""
        notes = self.record.notes if self.record is not None else []
        return next((n.removeprefix("block ended with ") for n in notes if n.startswith("block ended with ")), None)

    def report(self, top: int = 20) -> dict[str, Any]:
        """The same dict as ``tpudiag report --json RUN``."""
        if self.record is None:
            raise UsageError(f"run {self.id} is still being captured (its report exists once the block has ended)")
        from tpudiag import report
        from tpudiag.store import queries

        data = report.build(self.store, queries.resolve_run(self.store, self.id), top=top)
        loaded: dict[str, Any] = json.loads(json.dumps(data, default=str))
        return loaded

    def _repr_html_(self) -> str:
        from tpudiag.notebook_view import run_html

        if self.record is None:
            return f"<p>tpudiag run <code>{self.id}</code>: still being captured</p>"
        return run_html(self.report())

    def _mime_(self) -> tuple[str, str]:
        """marimo's display protocol."""
        return "text/html", self._repr_html_()

    def __repr__(self) -> str:
        return f"<tpudiag run {self.id} ({self.status}) in {self.store.path}>"


class Capture:
    """``with`` block or decorator; each ``with`` (each call of a decorated function) is one run."""

    def __init__(
        self,
        name: str | None = None,
        db: str | os.PathLike[str] | None = None,
        collect: str | Sequence[str] | None = None,
        numerics: str | int | None = None,
        budget: float | None = None,
    ) -> None:
        self.name = name
        self.store = open_store((Path(db) if db is not None else resolve_db_path(None)).absolute())
        self.collect = _collect_list(collect)
        check_names(self.collect)  # a bad name fails here, not when the block starts
        self.options = capture_options(numerics, budget)
        self._frames: list[tuple[BlockCapture | None, CapturedRun]] = []

    def __enter__(self) -> CapturedRun:
        global _active
        with _lock:  # held while the collectors start: a capture begun meanwhile in another thread joins this one
            outer = _active
            if outer is None:
                block = BlockCapture(self.store, self.name or "capture", self.collect, self.options)
                block.start()
                _active = block
        if outer is not None:
            if outer.session is not None:
                outer.session.note(f"a nested capture ({self.name or 'capture'}) joined this run")
            joined = CapturedRun(outer.store, outer.run_id, joined=True)
            self._frames.append((None, joined))
            return joined
        run = CapturedRun(self.store, block.run_id)
        self._frames.append((block, run))
        return run

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        global _active
        block, run = self._frames.pop()
        if block is None:
            return None  # a nested capture: the outer one stores the run
        try:
            run.record = block.stop(exc)
        except TpudiagError as err:
            if exc is None:
                raise
            # The block's own exception goes on unchanged; the store's failure is one line beside it.
            sys.stderr.write(f"tpudiag: run {run.id} could not be stored: {err}\n")
        finally:
            with _lock:
                _active = None
        return None  # never swallows the block's exception

    def __call__(self, fn: F) -> F:
        named = copy.copy(self)
        named.name = self.name or getattr(fn, "__qualname__", None) or "capture"
        named._frames = []

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with named:
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


@overload
def capture(func: F, /) -> F: ...


@overload
def capture(
    func: None = None,
    /,
    *,
    name: str | None = None,
    db: str | os.PathLike[str] | None = None,
    collect: str | Sequence[str] | None = None,
    numerics: str | int | None = None,
    budget: float | None = None,
) -> Capture: ...


def capture(
    func: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    db: str | os.PathLike[str] | None = None,
    collect: str | Sequence[str] | None = None,
    numerics: str | int | None = None,
    budget: float | None = None,
) -> Any:
    """Capture a block (``with tpudiag.capture(...) as run:``) or each call of a function (as a decorator).

    ``name``: the run's name (default "capture", or the function's name); ``db``: the store (default
    ``$TPUDIAG_DB`` or ./tpudiag.duckdb); ``collect``: collectors, a list or "trace,numerics" (default: every
    available one; "none" for none); ``numerics``: which ops the numerics collector checks (sample, N, all, off);
    ``budget``: numerics' time budget in percent.  Bad values raise ``tpudiag.errors.UsageError``.
    """
    if func is not None:
        if not callable(func):
            raise UsageError("tpudiag.capture takes keyword arguments (name=..., db=...), or decorates a function")
        return Capture()(func)
    return Capture(name=name, db=db, collect=collect, numerics=numerics, budget=budget)
