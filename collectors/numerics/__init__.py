"""The numerics collector: every aten op re-run on a CPU float64 oracle (see collector.py and DESIGN §4.2)."""

from tpudiag.collectors.numerics.collector import NumericsCollector

__all__ = ["NumericsCollector"]
