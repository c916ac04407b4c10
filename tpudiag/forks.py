"""A process forked inside a capture runs as it would without tpudiag (first rule).

``fork`` is Linux's default start method: DataLoader workers, ``multiprocessing`` pools and processes, and a
script's own ``os.fork()`` start as copies of the capturing process, with the capture in them: the module-call
wrapper and its listeners, the optimizer hook, tpudiag's dispatch modes, an open profiler session, the run's state.
None of the capture's threads (pulse writer, flusher, samplers) exists in the copy.  Measured before this module:

- a DataLoader whose dataset calls a module (torchvision's v2 transforms are modules) made steps in each worker,
  opened and closed trace windows there (a worker's "slow step"), and exported the worker's trace over the
  parent's: the first window of the run stored 0 events, and a window of a worker's steps was stored as the run's;
- a script's ``os.fork()`` child that went on to the script's end finished the capture as the run (its exit status
  stored as the run's), then hung; the parent waited on it until killed.

So the capture notes its process (``begin``); in a child forked from it, right after the fork
(``os.register_at_fork``), the parts registered with ``on_child`` let go (the wrapper and the optimizer hook come
off, tpudiag's dispatch modes are popped, an open trace window stops recording, tpudiag's errors go nowhere), the
spool refuses writes (``in_child``), and the capture's end does nothing there: the child's own exit is plain
Python's.  The parent counts its forks for the run's notes.  The child's work is not in the run.

Core module: no torch import.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator

from tpudiag import internal_errors

_owner: int | None = None  # the capturing process
_forks = 0  # children forked by it since ``begin``
_registered = False
_lock = threading.Lock()
_children: dict[int, tuple[str, Callable[[], None]]] = {}  # key -> (name, callback run in a forked child)
_serial = 0
_profiler_used = False  # Kineto ran in this process (``profiler_used``): its exit handler hangs in a forked child
_local = threading.local()  # ``own``: tpudiag's own forks in progress on this thread


def begin() -> None:
    """A capture starts in this process (a capture session's start)."""
    global _owner, _forks, _registered
    with _lock:
        _owner, _forks = os.getpid(), 0
        if not _registered and hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=_after_in_child, after_in_parent=_after_in_parent)
            _registered = True


def end() -> int:
    """The capture ended in this process: the number of children it forked."""
    global _owner
    with _lock:
        if _owner == os.getpid():
            _owner = None
        return _forks


def in_child() -> bool:
    """Whether this process was forked from a process that was capturing (then tpudiag does nothing here)."""
    return _owner is not None and _owner != os.getpid()


class ChildHook:
    """What ``on_child`` registered; ``remove()`` once the part has left (the capture's end)."""

    def __init__(self, key: int) -> None:
        self._key = key

    def remove(self) -> None:
        with _lock:
            _children.pop(self._key, None)


def on_child(name: str, callback: Callable[[], None]) -> ChildHook:
    """Run ``callback`` in every child forked while the capture runs, right after the fork.  It runs on the child's
    only thread before anything else, and must take no lock another thread may have held."""
    global _serial
    with _lock:
        _serial += 1
        _children[_serial] = (name, callback)
        return ChildHook(_serial)


@contextlib.contextmanager
def own() -> Iterator[None]:
    """tpudiag forks a process of its own in this block (a trace decoding worker): not counted as the script's."""
    _local.own = getattr(_local, "own", 0) + 1
    try:
        yield
    finally:
        _local.own -= 1


def _after_in_parent() -> None:
    global _forks
    if _owner == os.getpid() and not getattr(_local, "own", 0):
        _forks += 1


def profiler_used() -> None:
    """The profiler (Kineto) ran in this process: a child forked from it, even after the capture, skips the native
    exit handlers (``skip_native_exit_handlers``)."""
    global _profiler_used
    _profiler_used = True


def _after_in_child() -> None:
    global _lock
    if _profiler_used:
        with contextlib.suppress(Exception):
            skip_native_exit_handlers()
    if _owner is None or _owner == os.getpid():
        return
    try:
        _lock = threading.Lock()  # another thread of the parent may have held it at the fork
        internal_errors.begin(None)  # counted in memory, never written to the parent's run folder
        callbacks = [callback for _name, callback in _children.values()]
    except Exception:
        callbacks = []
    for callback in [*callbacks, _pop_dispatch_modes]:
        with contextlib.suppress(Exception):  # nowhere to record it (this process keeps no run): the child goes on
            callback()


def _pop_dispatch_modes() -> None:
    """tpudiag's dispatch modes (the numerics checker's, the memory collector's) off this thread's mode stack, the
    script's own kept in their order."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    c = torch._C
    modes = [c._get_dispatch_stack_at(i) for i in range(c._len_torch_dispatch_stack())]
    if not any(_ours(m) for m in modes):
        return
    for _ in modes:
        c._pop_torch_dispatch_stack(None)
    for mode in modes:
        if not _ours(mode):
            c._push_on_torch_dispatch_stack(mode)


def _ours(mode: object) -> bool:
    return type(mode).__module__.startswith("tpudiag.")


def skip_native_exit_handlers() -> None:
    """In a forked child: its exit ends the process once Python has finished, without the native exit handlers
    registered before the fork (C++ static destructors).  Kineto's configuration loader, started in the parent by
    the profiler, waits in its destructor on a condition variable that the parent's thread held: a child forked
    after any profiler session that exits through ``exit()`` (a script's ``os.fork()`` child running on to the
    script's end) hung there forever, and the parent waiting on it too.  glibc's ``on_exit`` passes the exit status
    to its handler, so ``_exit`` registered there (handlers run last-registered first) ends the process with the
    same status, after Python's own finalisation (atexit, stream flushes) is done; what native code left in C's
    stdio buffers is not flushed.  Elsewhere (no ``on_exit``): nothing."""
    import ctypes

    libc = ctypes.CDLL(None)
    on_exit, exit_now = getattr(libc, "on_exit", None), getattr(libc, "_exit", None)
    if on_exit is None or exit_now is None:
        return
    on_exit.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    on_exit(ctypes.cast(exit_now, ctypes.c_void_p), None)
