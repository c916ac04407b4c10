"""The one live status line tpudiag writes on stderr during long work (import, export, reading big logs).

On a terminal the line is rewritten in place (``\\r`` ... erase to end of line); on a pipe or file each update is
its own line, throttled, or left out entirely for chatty counters (``live_only``) so logs stay short.
"""

from __future__ import annotations

import sys
import time
from typing import IO

from tpudiag.console import prefix


class StatusLine:
    """``line("text")`` shows ``tpudiag: text`` at most once per ``interval_s`` (``force=True`` always)."""

    def __init__(self, stream: IO[str] | None = None, interval_s: float = 0.5, live_only: bool = False) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval_s = interval_s
        self.live_only = live_only
        self._last = float("-inf")  # the first line always shows
        self._shown = False

    def __call__(self, text: str, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        if self.tty:
            self.stream.write(f"\r{prefix()}: {text}\x1b[K")
        elif self.live_only:
            return
        else:
            self.stream.write(f"{prefix()}: {text}\n")
        self.stream.flush()
        self._shown = True

    def done(self, final: str | None = None) -> None:
        """End the line: with ``final``, replace it by that text (shown on a pipe too)."""
        if final is not None:
            start = "\r" if self.tty else ""
            self.stream.write(f"{start}{prefix()}: {final}" + ("\x1b[K\n" if self.tty else "\n"))
        elif self._shown and self.tty:
            self.stream.write("\n")
        self.stream.flush()
        self._shown = False

    def erase(self) -> None:
        """Take the live line off a terminal (a closing line of its own follows); nothing on a pipe."""
        if self._shown and self.tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
        self._shown = False


class Progress:
    """Events done out of a known total (exporters): live on a terminal, one closing line everywhere."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self._line = StatusLine(stream, interval_s=0.2, live_only=True)
        self._t0 = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        self._line(f"{self.label}: {self.done:,}/{self.total:,} events")

    def finish(self) -> None:
        elapsed = time.monotonic() - self._t0
        self._line.done(f"{self.label}: {self.done:,} events in {elapsed:.2f} s")
