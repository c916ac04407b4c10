"""tpudiag: which ops are slow, which ops give different numbers than a CPU reference, and what recompiles.

Public Python API (``tpudiag.api``, loaded on first use so ``import tpudiag`` stays cheap):
``tpudiag.capture(...)`` as a context manager or decorator; ``%load_ext tpudiag`` in IPython/Jupyter for the
``%%tpudiag`` cell magic (``tpudiag.notebook``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpudiag.version import __version__

if TYPE_CHECKING:
    from tpudiag.api import Capture, CapturedRun, capture
    from tpudiag.longrun.manual import trigger

__all__ = ["Capture", "CapturedRun", "__version__", "capture", "load_ipython_extension", "trigger"]
_API = ("capture", "Capture", "CapturedRun")


def __getattr__(name: str) -> Any:
    if name in _API:
        from tpudiag import api

        return getattr(api, name)
    if name == "trigger":  # issue 21: open a trace window in a running capture (tpudiag/longrun/manual.py)
        from tpudiag.longrun.manual import trigger

        return trigger
    raise AttributeError(f"module 'tpudiag' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext tpudiag``: the ``%%tpudiag`` cell magic."""
    from tpudiag.notebook import load_ipython_extension as load

    load(ipython)
