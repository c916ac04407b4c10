"""Baseline: run a script under a plain torch.profiler session (CPU, shapes), as a user would without tpudiag."""

from __future__ import annotations

import runpy
import sys
import tempfile

from torch.profiler import ProfilerActivity, profile


def main() -> None:
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        runpy.run_path(script, run_name="__main__")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)


if __name__ == "__main__":
    main()
