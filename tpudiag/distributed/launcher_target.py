"""Whether a capture's target is a distributed launcher (torchrun), told without importing the launcher's
machinery: every capture asks, before its script runs."""

from __future__ import annotations

from pathlib import Path

from tpudiag import runner

LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
LAUNCHER_SCRIPTS = ("torchrun",)


def normalize(target: runner.Target) -> runner.Target:
    """``torchrun ...`` given as the script (the console script's name, not a file here) is the module."""
    if target.kind == "script" and target.name in LAUNCHER_SCRIPTS and not Path(target.name).exists():
        return runner.Target("module", "torch.distributed.run", target.args)
    if target.kind == "script" and Path(target.name).name in LAUNCHER_SCRIPTS and Path(target.name).is_file():
        return runner.Target("module", "torch.distributed.run", target.args)
    return target


def is_launcher(target: runner.Target) -> bool:
    return target.kind == "module" and target.name in LAUNCHER_MODULES
