"""Built-in collectors (installed as ``tpudiag.collectors``): trace, numerics, compile."""
