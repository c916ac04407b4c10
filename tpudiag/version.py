"""tpudiag's version (its own module: recording it in a run never imports the package's public API)."""

__version__ = "0.1.0"
