"""SIGTERM under the capture: the run stored where the signal found the script, then death by the signal.

Python killed by SIGTERM (the default disposition) dies at once: none of the script's code runs after the signal,
no ``finally`` block, no ``__exit__``, no exit handler.  The capture has to store the run first.  It used to raise
an exception in the main thread to get out of the script, and that unwound the script's stack: its ``finally``
blocks and context managers ran (a checkpoint saved in a ``finally``, a file closed and renamed by a ``with``)
where python's never would.  Now the handler (``runner.run``) stores the run from the signal handler itself, in the
main thread (an open trace window's profiler is stopped by the thread that started it), and the process then dies
of the signal's default action (``kill_self``): the script's frames stay where they were.

Storing from inside the script's stack is safe only while the main thread runs the script's code, or torch's.
``decide`` reads the interrupted stack (``busy``): a tpudiag frame that is not a hand-off to the script's code (the
module-call wrapper or the compiled-graph wrapper, each inside the call it hands on), a Dynamo compile in progress
(tpudiag's compile callbacks are half done), an import in progress, or ``threading``'s code while it holds one of
its module locks (locks the store takes too) make it ``LATER``: the handler returns at once and the signal is sent
to the main thread again ``RETRY_EVERY_S`` later (from a thread that lives for that wait), until it lands in the
script's code.  After ``GIVE_UP_S`` of that it is ``UNWIND``: the old way (the run stored after the stack is
unwound) rather than a job that does not die.  A signal that was asked again but never came back (the script
ended meanwhile) still ends the run as interrupted by SIGTERM (``pending``).

A store that hangs in the handler (a lock the interrupted code holds after all) cannot keep the job alive: a
watchdog thread kills the process with SIGTERM's default action ``WATCHDOG_S`` after the signal.
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import CodeType, FrameType
from typing import Any, NoReturn

NOW, LATER, UNWIND = "now", "later", "unwind"
RETRY_EVERY_S = 0.002
GIVE_UP_S = 5.0
WATCHDOG_S = 120.0

# tpudiag's frames that hand a call on to the script's code, by file (relative to the package, as found through
# either of the two folders ``tpudiag/`` and ``collectors/``) and function: safe while they wait on that call.
HAND_OFFS = frozenset(
    {
        ("collectors/module_calls.py", "_call"),
        ("collectors/numerics/compiled/checker.py", "compiled_region"),
    }
)
RUNNER = "tpudiag/runner.py"  # the runner's frames: the script runs inside them; what lies below is the capture's

_first_at: float | None = None  # when the first SIGTERM of this run came (monotonic)
_pending = False  # a re-sent signal not yet handled
_roots: tuple[tuple[str, str], ...] | None = None  # (real folder + os.sep, name it is known by)
_names: dict[CodeType, str | None] = {}


def _package_roots() -> tuple[tuple[str, str], ...]:
    global _roots
    if _roots is None:
        here = Path(__file__).resolve().parent  # tpudiag/
        collectors = (here / "collectors").resolve()  # a link to the top-level collectors/ in a source checkout
        _roots = ((str(collectors) + os.sep, "collectors/"), (str(here) + os.sep, "tpudiag/"))
    return _roots


def _ours(code: CodeType) -> str | None:
    """``tpudiag/<file>`` or ``collectors/<file>`` for a code object of tpudiag's, else None."""
    try:
        return _names[code]
    except KeyError:
        pass
    name = None
    try:
        path = os.path.realpath(code.co_filename)
    except (OSError, ValueError):
        path = ""
    for root, label in _package_roots():
        if path.startswith(root):
            name = label + path[len(root) :].replace(os.sep, "/")
            break
    _names[code] = name
    return name


def busy(frame: FrameType | None, boundary: FrameType | None = None) -> bool:
    """Whether the stack from ``frame`` outwards (up to the runner's frames, ``boundary``, or its bottom) is in
    tpudiag's own code: a tpudiag frame that is not a hand-off waiting on a call to code that is not tpudiag's, a
    Dynamo compile in progress (tpudiag's compile callbacks have put torch's module call back meanwhile), or code
    that may hold a lock the store takes too (``_holds_shared_locks``)."""
    module_calls: Any = sys.modules.get("tpudiag.collectors.module_calls")
    if module_calls is not None and module_calls._compiling:
        return True
    callee_ours = False
    innermost = True
    f = frame
    while f is not None and f is not boundary:
        name = _ours(f.f_code)
        if name == RUNNER:
            return False
        if name is None and _holds_shared_locks(f.f_code):
            return True
        if name is not None and (innermost or callee_ours or (name, f.f_code.co_name) not in HAND_OFFS):
            return True
        callee_ours = name is not None
        innermost = False
        f = f.f_back
    return False


def _holds_shared_locks(code: CodeType) -> bool:
    """Code that may hold a lock the store needs too: an import in progress (importlib's module locks; the store
    would also meet the half-imported module), or ``threading``'s code while one of its module locks is taken
    (a thread's end holds one that joining the store's threads takes; a script that waits in ``join`` or on a
    queue, where the signal often lands, holds none)."""
    filename = code.co_filename
    if filename.startswith("<frozen importlib"):
        return True
    return filename == threading.__file__ and any(lock.locked() for lock in _threading_locks())


def _threading_locks() -> list[Any]:
    """``threading``'s module locks that deadlock when the thread that holds one takes it again (an ``RLock`` does
    not: taken again by the main thread, it is the main thread's)."""
    locks = (getattr(threading, name, None) for name in ("_active_limbo_lock", "_shutdown_locks_lock"))
    return [lock for lock in locks if lock is not None and hasattr(lock, "locked")]


def decide(frame: FrameType | None) -> str:
    """``NOW`` (store the run here), ``LATER`` (ask again: tpudiag's own code runs) or ``UNWIND`` (given up)."""
    global _first_at, _pending
    _pending = False
    now = time.monotonic()
    if _first_at is None:
        _first_at = now
    if not busy(frame):
        return NOW
    return LATER if now - _first_at < GIVE_UP_S else UNWIND


def ask_again() -> None:
    """The signal to the main thread again in ``RETRY_EVERY_S``, from a thread of its own (``_thread``: no lock of
    ``threading``'s, which the interrupted code may hold)."""
    global _pending
    _pending = True
    _thread.start_new_thread(_send_later, (threading.main_thread().ident,))


def _send_later(ident: int | None) -> None:
    try:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # (never to this thread)
        time.sleep(RETRY_EVERY_S)
        if ident is not None:
            signal.pthread_kill(ident, signal.SIGTERM)
    except Exception:  # the main thread gone: the process is ending anyway
        pass


def pending() -> bool:
    """A SIGTERM was asked again and has not come back (the script ended in between): it still ended the run."""
    return _pending


def finish(store_run: Callable[[], None]) -> NoReturn:
    """Store the run (``store_run``, guarded: a failure is one line, and the spool stays for the next command), then
    die of SIGTERM's default action.  Never returns."""
    _start_watchdog()
    try:
        store_run()
    except BaseException as err:  # (the script must die as python would, whatever failed here)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"tpudiag: the run could not be stored at SIGTERM ({type(err).__name__}: {err})\n")
    kill_self(signal.SIGTERM)
    os._exit(128 + signal.SIGTERM)  # (only where the signal could not be delivered)


def kill_self(sig: int) -> None:
    """End this process by ``sig`` with its default action, from the main thread (delivered before this returns)."""
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        signal.pthread_kill(threading.get_ident(), sig)
    except Exception:
        return


def _start_watchdog() -> None:
    with contextlib.suppress(Exception):
        _thread.start_new_thread(_watchdog, ())


def _watchdog() -> None:
    """``WATCHDOG_S`` after the signal, the process dies of it whatever the main thread does: SIGTERM's default
    action set from this thread (libc's ``signal``: python's may only be called from the main thread)."""
    with contextlib.suppress(Exception):
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    time.sleep(WATCHDOG_S)
    try:
        libc: Any = ctypes.CDLL(None)
        libc.signal(signal.SIGTERM, 0)  # SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)  # (delivered to the main thread, the only one not blocking it)
        time.sleep(5)
    finally:
        os._exit(128 + signal.SIGTERM)


def reset() -> None:
    """A new run in this process (the Python API, tests): nothing left of a previous run's signal."""
    global _first_at, _pending
    _first_at, _pending = None, False
