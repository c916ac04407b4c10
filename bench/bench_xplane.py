"""XPlane import speed: tpudiag import vs xprof's own ``framework_op_stats`` conversion of the same file.

Run on its own (``python -m bench.run xplane``) or as part of the import benchmark (``measure``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import BENCH_DIR

FIXTURES = BENCH_DIR.parent.parent / "shared" / "fixtures"
XPLANE_SOURCE = FIXTURES / "xla" / "jax_cpu_train_step.xplane.pb"

XPROF_OPSTATS = (
    "import sys, shutil, tempfile, os\n"
    "from xprof.convert import raw_to_tool_data as r\n"
    "d = tempfile.mkdtemp(); p = os.path.join(d, 'h.xplane.pb'); shutil.copy(sys.argv[1], p)\n"
    "data, _ = r.xspace_to_tool_data([p], 'framework_op_stats', {})\n"
    "assert data\n"
)


def _timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t0


def measure(work: Path) -> dict[str, Any]:
    """The XPlane figures, measured in ``work`` (a scratch folder)."""
    if not XPLANE_SOURCE.exists():
        return {}
    x = work / XPLANE_SOURCE.name
    shutil.copy(XPLANE_SOURCE, x)
    ours = _timed([sys.executable, "-m", "tpudiag", "import", str(x), "--db", str(work / "b.duckdb")])
    xprof = _timed([sys.executable, "-c", XPROF_OPSTATS, str(x)])
    return {
        "xplane": {
            "file": XPLANE_SOURCE.name,
            "tpudiag_import_s": round(ours, 2),
            "xprof_framework_op_stats_s": round(xprof, 2),
            "speedup_vs_xprof": round(xprof / ours, 2),
        }
    }


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tpudiag-bench-xplane-") as tmp:
        return measure(Path(tmp))


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
