"""A second process that decodes batches of trace text, so that decoding uses both cores.

Decoding a Kineto trace is CPU-bound Python (msgspec objects, per-event attribute maps) and holds the GIL, so a
thread cannot share it.  ``DecodeWorker`` forks one child that applies a function to batches of bytes sent over a
pipe and sends back the (picklable) result; the parent keeps decoding other batches meanwhile.  At most one batch
is in flight, so memory stays bounded.  Fork, not spawn: the child inherits the imported modules (no second
start-up) and the function's state; it is only used from the import command's own short-lived process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tpudiag import forks


class WorkerError(RuntimeError):
    """The worker failed (its exception, as text) or died; the caller falls back to decoding in-process."""


def fork_available() -> bool:
    return "fork" in multiprocessing.get_all_start_methods() and (os.cpu_count() or 1) >= 2


def keep_freed_memory() -> None:
    """Let glibc's malloc keep freed memory for reuse instead of returning it to the system at once.

    Decoding allocates and frees many arrays of a few MB.  By default glibc serves each from fresh pages (mmap, or
    a heap it trims on every free), so every array costs page faults, and in a forked pair of processes (whose pages
    are copy-on-write) those faults cost about as much as the decoding: a 1 M-event XPlane read took as long in
    two processes as in one.  Process-wide, so only for a short-lived process like the import command; a no-op where
    malloc is not glibc's.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    for option, value in ((_M_TRIM_THRESHOLD, 1 << 30), (_M_TOP_PAD, 256 << 20), (_M_MMAP_THRESHOLD, 32 << 20)):
        mallopt(option, value)


_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # <malloc.h>


class DecodeWorker:
    """One forked child applying ``fn`` to each batch; ``submit`` then ``result`` (one batch at a time)."""

    def __init__(self, fn: Callable[[bytes], Any]) -> None:
        ctx = multiprocessing.get_context("fork")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_serve, args=(fn, child, self._conn), name="tpudiag-decode", daemon=True)
        with forks.own():
            self._proc.start()
        child.close()
        self.busy = False

    def submit(self, batch: bytes) -> None:
        assert not self.busy, "one batch at a time"
        self._conn.send_bytes(batch)
        self.busy = True

    def ready(self) -> bool:
        return self.busy and self._conn.poll()

    def result(self) -> Any:
        """The result of the batch in flight (waits for it); raises ``WorkerError`` if the child failed."""
        try:
            ok, value = self._conn.recv()
        except (EOFError, OSError) as err:
            raise WorkerError(f"decode worker died ({err})") from None
        finally:
            self.busy = False
        if not ok:
            raise WorkerError(value)
        return value

    def kill(self) -> None:
        """Stop the child now (its batch in flight is not needed any more)."""
        self._proc.kill()
        self.busy = False

    def close(self) -> None:
        self._conn.close()  # the child sees EOF and exits
        self._proc.join(timeout=5)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    def __enter__(self) -> DecodeWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(fn: Callable[[bytes], Any], conn: Connection, parent_end: Connection) -> None:
    # Ctrl-C reaches the whole process group: the parent handles it and closes the pipe, which ends this loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent_end.close()
    while True:
        try:
            batch = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            reply = (True, fn(batch))
        except Exception:  # reported to the parent, which decodes in-process instead
            reply = (False, traceback.format_exc(limit=3))
        try:
            conn.send(reply)
        except OSError:  # the parent stopped listening (it failed or fell back): leave quietly
            return
