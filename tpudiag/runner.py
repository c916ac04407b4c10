"""Run a script or module exactly as ``python script.py args`` / ``python -m module args`` would.

``sys.argv``, ``sys.path[0]`` and ``__name__ == "__main__"`` are set as Python sets them; stdin/stdout/stderr are
left alone.  The outcome is returned, never raised: exit code, status, and the exception (already printed the way
Python prints it, with tpudiag's own frames removed).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import pkgutil
import runpy
import signal
import sys
import traceback
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from tpudiag import forks, termination
from tpudiag.errors import UsageError


@dataclass(frozen=True)
class Target:
    kind: str  # "script" | "module"
    name: str  # the path as given, or the module name
    args: tuple[str, ...]

    @property
    def display(self) -> str:
        return f"-m {self.name}" if self.kind == "module" else self.name


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    status: str  # "ok" | "failed" | "interrupted"
    error: str | None = None


# The script's module globals stay alive until the interpreter exits, as under ``python script.py``.  Dropping them
# when ``runpy`` returns would destroy the script's objects mid-process: a DDP model's gloo process group then joins
# its worker thread while holding the GIL that thread waits for (a hang seen in torchrun workers under capture).
_SCRIPT_GLOBALS: list[dict[str, object]] = []

# The signal the script ended by (``run``): SIGINT for a KeyboardInterrupt it did not catch, SIGTERM for the signal.
# Python dies of it (after its exit handlers, for SIGINT): the ``tpudiag`` command does too, once the run is stored
# (``cli.console_main``), so the parent sees the status it would see without tpudiag (-2 / -15, not 130 / 143).
ended_by_signal: int | None = None


# Called with the exception that ends the script, before its traceback is printed (the memory collector reads an
# out-of-memory error there).  A listener must not print or raise; what it raises is dropped.
_failure_listeners: list[Callable[[BaseException], None]] = []


def add_failure_listener(listener: Callable[[BaseException], None]) -> Callable[[], None]:
    """Call ``listener(exc)`` when the script ends with an exception; returns a function that removes it."""
    _failure_listeners.append(listener)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _failure_listeners.remove(listener)

    return remove


def tell_failure(exc: BaseException) -> None:
    """Give ``exc`` (the exception that ends the script or a captured block) to the failure listeners."""
    for listener in list(_failure_listeners):
        with contextlib.suppress(Exception):
            listener(exc)


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM, to unwind the script's stack and store the run after it, where the run
    is not stored from the signal handler (no ``on_sigterm``, or ``tpudiag.termination`` gave up waiting for the
    script's own code)."""


def check_target(target: Target) -> None:
    """Fail early, with one line, on a script or module that cannot be run."""
    if target.kind == "script":
        path = Path(target.name)
        if not path.exists():
            raise UsageError(f"can't open file {target.name!r}: no such file")
        if path.is_dir() and not (path / "__main__.py").exists():
            raise UsageError(f"can't find '__main__' module in {target.name!r}")
        return
    # Looked for where ``python -m`` looks (and ``run`` runs it): the working directory first, not the directory of
    # the ``tpudiag`` command.  Only the top-level name: finding ``pkg.mod`` imports ``pkg``, whose ``__init__`` would
    # then run here, before the capture and with tpudiag's ``sys.argv``; a missing submodule is told by runpy in
    # python's own words when the script runs.
    top = target.name.partition(".")[0]
    saved = sys.path[:1]
    sys.path[:1] = [os.getcwd()]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError) as err:
        raise UsageError(f"no module named {target.name!r} ({err})") from None
    finally:
        sys.path[:1] = saved
    if spec is None:
        raise UsageError(f"no module named {top!r}")


def _strip_runner_frames(tb: TracebackType | None) -> TracebackType | None:
    """Drop tpudiag's frames at the top, so the traceback starts where python's does: in the script's code for a
    script file, in runpy's two frames (``_run_module_as_main``, ``_run_code``) for ``-m``, a directory or a zip."""
    here = os.path.dirname(os.path.abspath(__file__))
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(here + os.sep):
        tb = tb.tb_next
    return tb


def _run_script_file(path: str) -> dict[str, object]:
    """``runpy.run_path(path, run_name="__main__")`` for a script (source or compiled) file, with the globals of
    python's own ``__main__`` (``run_path`` leaves out ``__annotations__`` and the loader, and gives ``__builtins__``
    as a dict).

    ``__file__`` and the loader's path are the path python gives them: a relative one joined to the working directory
    (not normalized: ``./t.py`` gives ``/cwd/./t.py``), so a script that changes directory still finds the files next
    to it.  The code's file name stays the path as typed: the stored source locations (profiler stacks, numerics
    sources, compile events: ``train.py:16``) and every reader of them take it so; python's tracebacks print the
    joined path, the capture's the typed one."""
    joined = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    with io.open_code(path) as f:
        code = pkgutil.read_code(f)  # a .pyc file (None for source)
    loader: importlib.abc.FileLoader = importlib.machinery.SourcelessFileLoader("__main__", joined)
    if code is None:
        with io.open_code(path) as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
        loader = importlib.machinery.SourceFileLoader("__main__", joined)
    # The globals python's own __main__ has (``add_main_module``, then the file's loader).
    with _fresh_main() as module:
        module.__dict__.update(__file__=joined, __cached__=None, __loader__=loader, __package__=None, __spec__=None)
        exec(code, module.__dict__)
    return module.__dict__


def _run_as_main(name: str, module_switch: bool) -> dict[str, object]:
    """What python does for ``-m name`` (``module_switch``) and for a directory or zip file with a ``__main__.py``
    (``sys.path[0]`` already that path): ``runpy._run_module_as_main`` in a fresh ``__main__``.  ``run_module`` and
    ``run_path`` differ from it in what the script sees (``run_path`` put the path as typed first on ``sys.path``)
    and in the traceback of an uncaught error (python's starts in runpy's two frames)."""
    with _fresh_main() as module:  # (runpy runs the code in ``sys.modules["__main__"].__dict__``: this module's)
        runpy._run_module_as_main(name, module_switch)  # type: ignore[attr-defined]
    return module.__dict__


@contextlib.contextmanager
def _fresh_main() -> Iterator[types.ModuleType]:
    """A new ``__main__`` module with the globals python's has before it runs anything (``add_main_module``), in
    ``sys.modules`` for the block; tpudiag's own ``__main__`` comes back after it."""
    module = types.ModuleType("__main__")
    module.__dict__.update(__annotations__={}, __builtins__=builtins)
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = module
    try:
        yield module
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _print_exception(exc: BaseException) -> str:
    """Print an exception the script did not catch as python does: through ``sys.excepthook`` (the script's own if
    it set one; else the interpreter's, which on 3.11 adds what ``traceback`` does not, e.g. "Did you mean")."""
    tb = _strip_runner_frames(exc.__traceback__)
    exc.__traceback__ = tb  # (the interpreter's hook prints the exception's own traceback, not its argument)
    summary = traceback.format_exception_only(type(exc), exc)[-1].strip()
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception as hook_err:  # as python does when the hook itself fails
        sys.stderr.write("Error in sys.excepthook:\n")
        sys.__excepthook__(type(hook_err), hook_err, hook_err.__traceback__)
        sys.stderr.write("\nOriginal exception was:\n")
        sys.__excepthook__(type(exc), exc, tb)
    sys.stderr.flush()
    return summary


def _ended_by(sig: int) -> None:
    global ended_by_signal
    if not forks.in_child():
        ended_by_signal = sig


def _exit_code_of(exc: SystemExit) -> int:
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, bool):
        return int(code)
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else code % 256
    sys.stderr.write(f"{code}\n")
    return 1


@contextlib.contextmanager
def signals_to_main_thread() -> Iterator[None]:
    """Threads started inside this block (and the threads they start) never receive SIGINT or SIGTERM.

    Python runs signal handlers in the main thread, but the kernel may deliver a process signal to any thread that
    does not block it; a signal taken by a background thread leaves a main thread that waits in C (``time.sleep``,
    a long kernel) unaware until it runs Python code again.  New threads inherit the signal mask of the thread that
    starts them, so tpudiag starts its own (flusher, profiler, DuckDB workers) with these two blocked.
    """
    if not hasattr(signal, "pthread_sigmask"):  # not on Windows
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@contextlib.contextmanager
def sigterm_restored() -> Iterator[None]:
    """The caller's SIGTERM disposition comes back at the end of the block: ``run`` ignores a SIGTERM that comes
    after the script (the store write must not be cut short), which in a process that goes on after the capture
    (the Python API, a test) had left SIGTERM ignored for good, and every child it started after ignored it too."""
    before = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if before is not None and signal.getsignal(signal.SIGTERM) is not before:
            with contextlib.suppress(ValueError):  # not the main thread: nothing was changed there either
                signal.signal(signal.SIGTERM, before)


def _default_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run(target: Target, on_sigterm: Callable[[Outcome], None] | None = None) -> Outcome:
    """Run the target in this process and report how it ended.

    ``on_sigterm``: what stores the run when SIGTERM ends the script (where the script has left SIGTERM's default
    disposition): called from the signal handler, with the script's stack as the signal found it, and the process
    then dies of the signal (``tpudiag.termination``).  Without it the script's stack is unwound (``Terminated``)
    and ``run`` returns the outcome."""
    outcome = _run(target, on_sigterm)
    if termination.pending() and outcome.status != "interrupted":
        # A SIGTERM asked again (tpudiag's own code was running) that the script's end overtook: it ended the run.
        _ended_by(signal.SIGTERM)
        return Outcome(143, "interrupted", "SIGTERM")
    return outcome


def _run(target: Target, on_sigterm: Callable[[Outcome], None] | None) -> Outcome:
    saved_argv, saved_path0 = sys.argv[:], sys.path[0] if sys.path else None
    previous_term = signal.getsignal(signal.SIGTERM)
    forget_child: forks.ChildHook | None = None
    termination.reset()
    if previous_term in (signal.SIG_DFL, None):

        def on_term(signum: int, frame: FrameType | None) -> None:
            if on_sigterm is None or forks.in_child():
                raise Terminated()
            decision = termination.decide(frame)
            if decision == termination.LATER:
                termination.ask_again()  # tpudiag's own code runs: the script's comes back in a moment
                return
            if decision == termination.UNWIND:
                raise Terminated()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # another SIGTERM must not cut the store write short
            _ended_by(signal.SIGTERM)
            termination.finish(lambda: on_sigterm(Outcome(143, "interrupted", "SIGTERM")))

        signal.signal(signal.SIGTERM, on_term)
        # A child forked by the script (a DataLoader worker) dies of SIGTERM as it would without tpudiag: the
        # default handler is back in it right after the fork.
        forget_child = forks.on_child("sigterm", _default_sigterm)
    try:
        if target.kind == "script":
            # As python sets it, ``sys.path[0]`` is the real directory of a script file (a symbolic link resolved),
            # a directory or zip file itself.  ``__file__`` is python's (a relative path joined to the working
            # directory); the file name of the script's code stays the path as typed (``_run_script_file``).
            script = target.name
            sys.argv = [target.name, *target.args]
            as_file = pkgutil.get_importer(script) is None  # a script file (runpy's own test: no sys.path entry)
            script_dir = os.path.dirname(os.path.realpath(script)) if as_file else os.path.abspath(script)
            if sys.path:
                sys.path[0] = script_dir
            else:
                sys.path.insert(0, script_dir)
            if as_file:
                _SCRIPT_GLOBALS.append(_run_script_file(script))
            else:  # a directory or zip file with a __main__.py, found through sys.path[0]
                _SCRIPT_GLOBALS.append(_run_as_main("__main__", module_switch=False))
        else:
            sys.argv = ["-m", *target.args]  # as python's while the module is found, then the module's file
            if sys.path:
                sys.path[0] = os.getcwd()
            _SCRIPT_GLOBALS.append(_run_as_main(target.name, module_switch=True))
        return Outcome(0, "ok")
    except SystemExit as exc:
        code = _exit_code_of(exc)
        return Outcome(code, "ok" if code == 0 else "failed", None if code == 0 else f"SystemExit({exc.code!r})")
    except KeyboardInterrupt as exc:
        _print_exception(exc)
        _ended_by(signal.SIGINT)
        return Outcome(130, "interrupted", "KeyboardInterrupt")
    except Terminated:
        _ended_by(signal.SIGTERM)
        return Outcome(143, "interrupted", "SIGTERM")
    except BaseException as exc:
        tell_failure(exc)
        summary = _print_exception(exc)
        return Outcome(1, "failed", summary)
    finally:
        if forget_child is not None:
            forget_child.remove()
        # (Not in a forked child that ran on to the script's end: it stores nothing, and exits as without tpudiag.)
        if (
            not forks.in_child()
            and signal.getsignal(signal.SIGTERM) is not previous_term
            and previous_term in (signal.SIG_DFL, None)
        ):
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a late SIGTERM must not cut the store write short
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0
