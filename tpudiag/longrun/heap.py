"""Give the memory a trace window or a checked stretch freed back to the system (glibc's ``malloc_trim``).

A window's profiler results and the numerics checker's float64 copies are freed when the window or the checked
stretch ends, but glibc keeps most freed heap pages mapped (its ``mmap`` threshold grows after the first large
free, so later large blocks come from the heap).  Without a trim the process's RSS kept each window's high-water
mark for minutes: +100-250 MB on the long-run loop, which looked like growth and set off ``memory`` windows of
tpudiag's own making.  ``malloc_trim(0)`` returns free pages (a few ms after a window, ~50 us when nothing is free).
Elsewhere than glibc (macOS, musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import sys
import time
from typing import Any

_trim: Any = None
_looked = False
_last: dict[str, float] = {}  # the last trim of each caller


def _load() -> Any:
    global _trim, _looked
    if not _looked:
        _looked = True
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None).malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                _trim = fn
            except (OSError, AttributeError):
                _trim = None
    return _trim


def release(min_interval_s: float = 0.0, caller: str = "") -> bool:
    """Trim the heap now (at most once every ``min_interval_s`` for this ``caller``); False where there is nothing
    to call."""
    fn = _load()
    if fn is None:
        return False
    now = time.monotonic()
    if min_interval_s and now - _last.get(caller, -min_interval_s) < min_interval_s:
        return False
    _last[caller] = now
    try:
        fn(0)
    except Exception:  # a libc without it after all: never the script's problem
        return False
    return True
