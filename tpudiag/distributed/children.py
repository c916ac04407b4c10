"""The Python processes a captured script starts: elastic-agent workers made ranks, the others counted as missed.

While the script runs, two of Python's process starters are wrapped (and put back afterwards):

- ``subprocess.Popen._execute_child`` (every ``subprocess`` call, and torchelastic's worker handler): a Python
  command whose environment carries ``TORCHELASTIC_RUN_ID`` is a worker of torchrun's elastic agent, whatever
  launcher runs the agent in this process (``accelerate launch``, a custom ``elastic_launch``...): its interpreter
  is swapped for the run's worker wrapper (``tpudiag.distributed.wrapper.write_wrapper``), so the worker becomes a
  rank of this run.  So is the single process ``accelerate launch`` starts without the elastic agent (``--cpu``,
  one process).  Any other Python command is a process tpudiag does not reach;
- ``multiprocessing``'s ``BaseProcess.start``: a process running a user's function (``Process``, ``Pool``,
  ``ProcessPoolExecutor``) is one tpudiag does not reach.

Not counted: processes torch's own code starts (DataLoader workers, Inductor's compile, load-test and autotune
processes: the first caller outside the standard library is in the torch package), multiprocessing's own helper
processes, workers of
``torch.multiprocessing.spawn`` (``tpudiag.distributed.spawn`` makes them ranks) and tpudiag's own processes.  The
run's notes then say how many Python processes were missed and how to capture them.  Every wrapper is pass-through:
the process starts exactly as before whatever tpudiag's own code does.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

MISSED_MARK = "that tpudiag did not capture"  # the note's words other modules look for
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_SKIP_TARGETS = (
    "torch.utils.data",
    "torch._inductor",
    "multiprocessing.managers",
    "multiprocessing.resource",
    "tpudiag",
)
_SKIP_ARGS = ("compile_worker", "torch/_inductor", "torch._inductor")  # Inductor's compile and autotune workers
MAX_LISTED = 3
LAUNCHERS = ("torchrun", "accelerate", "accelerate-launch")
LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch", "accelerate.commands.launch")


def is_python(program: str | None) -> bool:
    """A Python interpreter, or a script whose ``#!`` line runs one."""
    if not program:
        return False
    found = shutil.which(program) if os.sep not in program else program
    if not found:
        return False
    if _PYTHON.match(Path(found).name) or os.path.realpath(found) == os.path.realpath(sys.executable):
        return True
    try:
        with open(found, "rb") as fh:
            head = fh.read(128)
    except OSError:
        return False
    return head.startswith(b"#!") and b"python" in head.split(b"\n", 1)[0]


def is_launched_worker(env: Any) -> bool:
    """A worker a launcher in this process starts: torchelastic's (``TORCHELASTIC_RUN_ID``, any launcher on the
    elastic agent), or the one process of ``accelerate launch``'s simple launcher (accelerate's launch command is
    loaded here and hands the child ``ACCELERATE_*`` settings this process does not have)."""
    if "TORCHELASTIC_RUN_ID" in env:
        return True
    if "accelerate.commands.launch" not in sys.modules:
        return False
    return any(str(k).startswith("ACCELERATE_") and k not in os.environ for k in env)


def started_by_torch() -> bool:
    """The process is being started by torch's own code (Inductor's compile, load-test and autotune processes, a
    DataLoader...): the first caller outside the standard library and this module is a file of the torch package."""
    torch = sys.modules.get("torch")
    root = os.path.dirname(getattr(torch, "__file__", None) or "")
    if not root:
        return False
    stdlib = os.path.dirname(os.__file__) + os.sep
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(root + os.sep):
            return True
        library = name.startswith(stdlib) and "-packages" not in name  # site-/dist-packages may sit under it
        if name != __file__ and not library:
            return False
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _module_of(fn: Any) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return str(getattr(fn, "__module__", "") or "")


class ChildWatch:
    """``install()`` before the script runs, ``remove()`` after; ``missed`` lists the processes not reached."""

    def __init__(self, wrapper: Path | None) -> None:
        self.wrapper = wrapper  # elastic workers' new interpreter (None: leave them, count them as missed)
        self.missed: list[str] = []
        self.reached = 0  # elastic-agent workers routed through the wrapper
        self._saved: list[tuple[Any, str, Any]] = []

    # -- subprocess ---------------------------------------------------------------------------------------------
    def _command(self, args: Any, executable: Any, env: Any) -> Any:
        """The command to start: an elastic worker's through the wrapper; records a Python one it does not reach."""
        argv = [os.fsdecode(a) for a in ([args] if isinstance(args, (str, bytes, os.PathLike)) else list(args))]
        program = os.fsdecode(executable) if executable is not None else (argv[0] if argv else None)
        if not argv or not is_python(program) or any(s in a for a in argv for s in _SKIP_ARGS):
            return args
        if any(a.startswith("tpudiag") for a in argv[1:4]):  # python -m tpudiag...: tpudiag's own process
            return args
        if Path(argv[0]).name in LAUNCHERS or any(a in LAUNCHER_MODULES for a in argv[1:4]):
            # A launcher the script starts: its elastic agent reads PYTHON_EXEC, so its workers are ranks.
            return args
        environ = env if env is not None else os.environ
        if self.wrapper is not None and executable is None and is_launched_worker(environ):
            self.reached += 1
            return [str(self.wrapper), *argv[1:]]
        if started_by_torch():
            return args
        shown = [Path(argv[0]).name, *(a.strip().split("\n")[0][:60] for a in argv[1:3])]
        self.missed.append("subprocess: " + " ".join(shown) + (" ..." if len(argv) > 3 else ""))
        return args

    def _wrap_popen(self) -> None:
        import subprocess

        original = subprocess.Popen._execute_child  # type: ignore[attr-defined]
        watch = self

        @functools.wraps(original)
        def _execute_child(self: Any, args: Any, executable: Any, *rest: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(Exception):
                env = rest[4] if len(rest) > 4 else kwargs.get("env")  # (preexec_fn, close_fds, pass_fds, cwd, env)
                args = watch._command(args, executable, env)
            return original(self, args, executable, *rest, **kwargs)

        self._saved.append((subprocess.Popen, "_execute_child", original))
        subprocess.Popen._execute_child = _execute_child  # type: ignore[attr-defined]

    # -- multiprocessing ----------------------------------------------------------------------------------------
    def _process(self, proc: Any) -> None:
        target = getattr(proc, "_target", None)
        if target is None:
            return
        module = _module_of(target)
        if module.startswith(_SKIP_TARGETS) or started_by_torch():
            return
        if module.startswith("torch.multiprocessing"):  # torch.multiprocessing.spawn: ranks (or noted, on fork)
            return
        if module.startswith("concurrent.futures"):  # an executor's worker: skip torch's own pools
            initializer = next((a for a in getattr(proc, "_args", ()) if callable(a)), None)
            if initializer is not None and _module_of(initializer).startswith(("torch.", "tpudiag")):
                return
        name = getattr(target, "__qualname__", None) or type(target).__name__
        self.missed.append(f"multiprocessing: {module}.{name}" if module else f"multiprocessing: {name}")

    def _wrap_multiprocessing(self) -> None:
        import multiprocessing.process as mp_process

        original = mp_process.BaseProcess.start
        watch = self

        @functools.wraps(original)
        def start(self: Any) -> None:
            with contextlib.suppress(Exception):
                watch._process(self)
            original(self)

        self._saved.append((mp_process.BaseProcess, "start", original))
        mp_process.BaseProcess.start = start  # type: ignore[method-assign]

    def install(self) -> None:
        for wrap in (self._wrap_popen, self._wrap_multiprocessing):
            with contextlib.suppress(Exception):
                wrap()

    def remove(self) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()

    def note(self) -> str | None:
        """The run's note about the Python processes not reached, or None."""
        if not self.missed:
            return None
        listed = "; ".join(dict.fromkeys(self.missed[:MAX_LISTED]))
        more = f"; and {len(self.missed) - MAX_LISTED} more" if len(self.missed) > MAX_LISTED else ""
        return (
            f"the script started {len(self.missed)} Python process(es) {MISSED_MARK} ({listed}{more}): any torch work "
            "they did is not in this run. To capture it, start them with torchrun, an elastic-agent launcher "
            "(accelerate launch) or torch.multiprocessing.spawn, whose workers become ranks of this run, or run their "
            "own command under `tpudiag capture`"
        )
