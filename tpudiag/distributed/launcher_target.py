"""Whether a capture's target is a distributed launcher (torchrun), told without importing the launcher's
machinery: every capture asks, before its script runs.  A bare command name (``torchrun``, ``accelerate``, any
console script) is found on ``PATH`` as the shell would find it."""

from __future__ import annotations

import shutil
from pathlib import Path

from tpudiag import runner
from tpudiag.errors import UsageError

LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
LAUNCHER_SCRIPTS = ("torchrun",)


def resolve(name: str) -> str | None:
    """A console script's path when ``name`` is a bare command on ``PATH`` and no file here; else None."""
    if "/" in name or Path(name).exists():
        return None
    return shutil.which(name)


def normalize(target: runner.Target) -> runner.Target:
    """``torchrun ...`` given as the script (the console script's name, not a file here) is the module; any other
    bare command name is the Python script ``PATH`` names (``accelerate launch ...``)."""
    if target.kind != "script":
        return target
    found = resolve(target.name)
    if Path(target.name).name in LAUNCHER_SCRIPTS and (found or Path(target.name).is_file()):
        return runner.Target("module", "torch.distributed.run", target.args)
    if found is not None:
        from tpudiag.distributed.children import is_python

        if not is_python(found):
            raise UsageError(f"{target.name} ({found}) is not a Python script: tpudiag captures Python programs")
        if _is_interpreter(found):  # tpudiag capture python [-u] script.py ...: the script (or -m module)
            return _python_command(list(target.args))
        return runner.Target("script", found, target.args)
    return target


def _is_interpreter(path: str) -> bool:
    with open(path, "rb") as fh:
        return not fh.read(2).startswith(b"#!")


def _python_command(args: list[str]) -> runner.Target:
    while args and args[0] in ("-u", "-B", "-O"):
        args.pop(0)
    if len(args) >= 2 and args[0] == "-m":
        return normalize(runner.Target("module", args[1], tuple(args[2:])))
    if not args or args[0].startswith("-"):
        raise UsageError("after python, give a script or -m module (tpudiag capture script.py ...)")
    return normalize(runner.Target("script", args[0], tuple(args[1:])))


def is_launcher(target: runner.Target) -> bool:
    return target.kind == "module" and target.name in LAUNCHER_MODULES
