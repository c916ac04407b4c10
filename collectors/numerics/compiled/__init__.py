"""Numerics inside torch.compile regions: every Dynamo graph, whatever the backend, checked against a float64
replay of the same graph (``intercept`` sees the graphs, ``checker`` checks sampled calls, ``localise`` finds the
FX node where a divergence starts, ``repro`` writes a runnable bundle per failing graph)."""

from tpudiag.collectors.numerics.compiled.checker import CheckerContext, CompiledChecker

__all__ = ["CheckerContext", "CompiledChecker"]
