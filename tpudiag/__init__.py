"""tpudiag: which ops are slow, which ops give different numbers than a CPU reference, and what recompiles."""

from __future__ import annotations

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``tpudiag.trigger`` loads on first use (``import tpudiag`` stays light)."""
    if name == "trigger":
        from tpudiag.longrun.manual import trigger

        return trigger
    raise AttributeError(f"module 'tpudiag' has no attribute {name!r}")
