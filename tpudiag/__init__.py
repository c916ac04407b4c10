"""tpudiag: which ops are slow, which ops give different numbers than a CPU reference, and what recompiles."""

from __future__ import annotations

__version__ = "0.1.0"
