"""A capture's line to a background child of its own (the window analyst, the store feeder): the child sleeps
until the capture has something for it, instead of polling files several times a second for a whole run.

On a machine whose cores the script keeps busy, each wake of an idle child is the script's time: a poll of two
plain paths cost ~95 us of CPU on the long-run bench loop's core, cold after the loop's steps, and the loop paid for
its caches after.  The analyst polled 4 times a second and the feeder 5: ~0.1% of a core in the polls alone, and in
the capture's steady state the children had nothing else to do.

The line is a pipe: the child's stdin is its read end, the capture keeps the write end.

- ``Line`` (the capture): ``poke()`` writes a byte (a new job, or "leave now": the child looks at its files at
  once), never blocks, never fails.  ``close()`` after the child has left.
- ``ParentLine`` (the child): ``wait(timeout, unlined)`` returns at a poke, at the timeout, or at once when the
  capture is gone: a process's pipe ends close with it, and the child reads end-of-file.  From then on (or where
  stdin is no pipe: an older capture, ``/dev/null``) ``wait`` sleeps ``unlined``, the poll it replaces.
- ``start_child`` starts a child on a new line (the capture's read end closed once the child holds its copy).

A script that forks (a ``DataLoader``'s workers) copies the write end into its children, where it would keep the
line open after the capture died: those children close it (``os.register_at_fork``), and a child of ours still
checks its parent's pid at each timeout, for forks that bypass Python.
"""

from __future__ import annotations

import contextlib
import os
import select
import stat
import subprocess
import time
import weakref
from typing import Any

_open_lines: weakref.WeakSet[Line] = weakref.WeakSet()


class Line:
    """The capture's end: create it, pass ``read_fd`` as the child's stdin, then ``started()``."""

    def __init__(self) -> None:
        self.read_fd, self.write_fd = os.pipe()  # both close on exec: only the child's stdin is a copy
        os.set_blocking(self.write_fd, False)
        _open_lines.add(self)

    def started(self) -> None:
        """The child holds its copy: the capture's read end goes (or the pipe would never read end-of-file)."""
        self._close("read_fd")

    def poke(self) -> None:
        with contextlib.suppress(OSError):  # a full pipe already wakes the child; a child gone: nothing to wake
            os.write(self.write_fd, b"!")

    def close(self) -> None:
        self._close("read_fd")
        self._close("write_fd")
        _open_lines.discard(self)

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd >= 0:
            setattr(self, name, -1)
            with contextlib.suppress(OSError):
                os.close(fd)


def start_child(argv: list[str], **popen: Any) -> tuple[subprocess.Popen[bytes], Line]:
    """``subprocess.Popen(argv, **popen)`` with a new line as the child's stdin; raises ``Popen``'s ``OSError``
    (the line closed)."""
    line = Line()
    try:
        proc: subprocess.Popen[bytes] = subprocess.Popen(argv, stdin=line.read_fd, **popen)
    except OSError:
        line.close()
        raise
    line.started()
    return proc, line


def _forked_child() -> None:
    for line in list(_open_lines):
        line.close()


os.register_at_fork(after_in_child=_forked_child)


class ParentLine:
    """The child's end (its stdin)."""

    def __init__(self, fd: int = 0) -> None:
        self.fd = fd
        try:
            self.open = stat.S_ISFIFO(os.fstat(fd).st_mode)
        except OSError:
            self.open = False

    def wait(self, timeout_s: float, unlined_s: float) -> bool:
        """Until a poke, ``timeout_s``, or (at once) the capture's end of the line closing; ``unlined_s`` where
        there is no line (any more).  True when it was poked."""
        if not self.open:
            time.sleep(unlined_s)
            return False
        try:
            ready, _, _ = select.select([self.fd], [], [], timeout_s)
            if ready:
                if os.read(self.fd, 4096):
                    return True
                self.open = False  # the capture is gone (or closed its end): the callers look at why
        except (OSError, ValueError):
            self.open = False
            time.sleep(unlined_s)
        return False
