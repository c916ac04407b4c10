"""tpudiag's own failures inside the user's execution: caught, counted, written down, survived.

Code that runs in the script's context (the dispatch mode, module-call and optimizer hooks, logging handlers,
profiler callbacks) goes through ``InternalErrors.guard`` or calls ``record`` from an ``except`` clause.  Nothing
reaches the script: the error is counted per (collector, exception type, where), the first traceback of each
distinct error is appended to ``<run dir>/errors.txt`` at once (a capture killed later still has it), and the
closing line and the report say how many there were.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ERRORS_FILE = "errors.txt"
NOTE_PREFIX = "internal errors:"
_MAX_TRACEBACKS = 50


@dataclass(frozen=True)
class ErrorKey:
    component: str  # the collector or hook ("numerics", "trace", "compile", "module hooks")
    exc_type: str
    where: str  # the op or hook ("aten::convolution", "optimizer step hook")


class InternalErrors:
    """Counts of tpudiag's own exceptions in one capture (thread-safe; never raises)."""

    def __init__(self, run_dir: Path | None = None) -> None:
        self.run_dir = run_dir
        self.counts: dict[ErrorKey, int] = {}
        self._lock = threading.Lock()
        self._written = 0

    @property
    def path(self) -> Path | None:
        return self.run_dir / ERRORS_FILE if self.run_dir is not None else None

    def record(self, component: str, where: str, err: BaseException) -> None:
        """Count ``err`` (call from an ``except`` clause); the first traceback of each distinct error is saved."""
        try:
            key = ErrorKey(component, type(err).__name__, where)
            with self._lock:
                first = key not in self.counts
                self.counts[key] = self.counts.get(key, 0) + 1
                if not first or self._written >= _MAX_TRACEBACKS or self.path is None:
                    return
                self._written += 1
                text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
                with self.path.open("a", encoding="utf-8") as f:
                    f.write(f"== {component}: {key.exc_type} in {where}\n{text}\n")
        except Exception:  # recording must never become the error that reaches the script
            pass

    @contextlib.contextmanager
    def guard(self, component: str, where: str) -> Iterator[None]:
        """Run a block of tpudiag code; an exception in it is recorded and swallowed."""
        try:
            yield
        except Exception as err:
            self.record(component, where, err)

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def summary(self) -> str | None:
        """``2 internal errors (numerics: TypeError in aten::convolution)``, or None when there were none."""
        with self._lock:
            items = sorted(self.counts.items(), key=lambda kv: -kv[1])
        if not items:
            return None
        n = sum(c for _, c in items)
        shown = "; ".join(
            f"{k.component}: {k.exc_type} in {k.where}" + (f" x{c}" if c > 1 else "") for k, c in items[:3]
        )
        more = f"; {len(items) - 3} more kinds" if len(items) > 3 else ""
        return f"{n} internal error{'s' if n != 1 else ''} ({shown}{more})"

    def closing_line(self) -> str | None:
        """The line the capture prints (and the report shows first) when tpudiag failed inside the script."""
        summary = self.summary()
        if summary is None:
            return None
        where = f"; see {self.path}" if self.path is not None else ""
        return f"{summary} — the script was not affected{where}"


# The errors object of the capture in progress: hooks installed process-wide (module calls, optimizer steps)
# record into it.  A fresh one stands in outside a capture, so guarded code never needs a None check.
_current = InternalErrors()


def current() -> InternalErrors:
    return _current


def begin(run_dir: Path | None) -> InternalErrors:
    """A fresh count for a new capture (``run_dir`` None: counted only, no errors.txt)."""
    global _current
    _current = InternalErrors(run_dir)
    return _current
