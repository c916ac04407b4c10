"""One number of a Linux ``/proc`` file, read again and again through a descriptor kept open (``pread`` at offset
0 regenerates the file: one syscall a reading, where open + read + close cost ~3x that).

Used where a figure is read often: the memory collector's resident set (``/proc/self/statm``), the pulse's stall
clock (``/proc/thread-self/schedstat``, ``/proc/stat``).  Elsewhere than Linux the file does not open and every
reading is None.
"""

from __future__ import annotations

import contextlib
import os


class ProcField:
    """The ``index``-th whitespace-separated field of ``path`` (from its start, across lines), as an int."""

    def __init__(self, path: str, index: int, size: int = 128) -> None:
        self.index, self.size = index, size
        try:
            self._fd: int | None = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self._fd = None

    def read(self) -> int | None:
        """The field now, or None (no file, or one that did not read as expected)."""
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, self.size, 0).split()[self.index])
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
