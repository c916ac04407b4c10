"""XPlane import speed: tpudiag import vs xprof's own ``framework_op_stats`` conversion of the same file.

Two files, each timed both ways in this run (interleaved, min of ``TPUDIAG_BENCH_XPLANE_REPEATS``, default 3):
the jax fixture (3,349 events: process start-up dominates) and a large synthetic TPU device-plane XSpace built
with the sample generator's builder (``TPUDIAG_BENCH_XPLANE_EVENTS`` events, default 1,000,000: four TPU planes of
``Steps``/``XLA Modules``/``XLA Ops``, per-event ``group_id`` stats, shared op metadata).  Peak RSS is that of the
measured process.  Both sides run with a warm bytecode cache in a private ``PYTHONPYCACHEPREFIX`` (xprof's
installed modules are precompiled; an editable tpudiag under ``PYTHONDONTWRITEBYTECODE`` would recompile on every
start).  Run on its own (``python -m bench.run xplane``) or as part of the import benchmark (``measure``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
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
# Runs one command and reports its wall time and peak RSS (the wrapper's only child).
_MEASURE = (
    "import resource, subprocess, sys, time\n"
    "t = time.perf_counter(); subprocess.run(sys.argv[1:], check=True, capture_output=True)\n"
    "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
)


def _env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
    return env


def _measure(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds, peak RSS in MiB) of ``cmd`` in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _MEASURE, *cmd], check=True, capture_output=True, text=True, env=env)
    seconds, rss_kib = out.stdout.split()
    return float(seconds), int(rss_kib) / 1024


def compare(path: Path, work: Path, repeats: int) -> dict[str, Any]:
    """tpudiag import vs xprof framework_op_stats on ``path``: interleaved, min of ``repeats`` (one warm-up each)."""
    env = _env(work)
    ours_cmd = [sys.executable, "-m", "tpudiag", "import", str(path), "--db", str(work / "b.duckdb")]
    xprof_cmd = [sys.executable, "-c", XPROF_OPSTATS, str(path)]
    ours: list[tuple[float, float]] = []
    xprof: list[tuple[float, float]] = []
    for i in range(repeats + 1):
        for cmd, into in ((ours_cmd, ours), (xprof_cmd, xprof)):
            (work / "b.duckdb").unlink(missing_ok=True)
            shutil.rmtree(work / "b.runs", ignore_errors=True)
            result = _measure(cmd, env)
            if i:  # the first round warms the bytecode cache
                into.append(result)
    ours_s, xprof_s = min(t for t, _ in ours), min(t for t, _ in xprof)
    return {
        "file": path.name,
        "bytes": path.stat().st_size,
        "tpudiag_import_s": round(ours_s, 3),
        "xprof_framework_op_stats_s": round(xprof_s, 3),
        "speedup_vs_xprof": round(xprof_s / ours_s, 2),
        "tpudiag_peak_rss_mib": round(max(r for _, r in ours)),
        "xprof_peak_rss_mib": round(max(r for _, r in xprof)),
    }


def _events(path: Path) -> int:
    from tpudiag.traces import xplane_proto

    space = xplane_proto.parse_xspace(path.read_bytes())
    return sum(len(line.events) for plane in space.planes for line in plane.lines)


def large_xspace(path: Path, events: int) -> int:
    """Write the large synthetic TPU XSpace; returns its event count."""
    sys.path.insert(0, str(BENCH_DIR.parent / "sample_traces"))
    try:
        import generate  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    space = generate.tpu_large_xspace(events)
    path.write_bytes(space.SerializeToString())
    return sum(len(line.events) for plane in space.planes for line in plane.lines)


def measure(work: Path) -> dict[str, Any]:
    """The XPlane figures, measured in ``work`` (a scratch folder)."""
    repeats = int(os.environ.get("TPUDIAG_BENCH_XPLANE_REPEATS", "3"))
    out: dict[str, Any] = {}
    if XPLANE_SOURCE.exists():
        x = work / XPLANE_SOURCE.name
        shutil.copy(XPLANE_SOURCE, x)
        out["xplane"] = {"events": _events(x), **compare(x, work, repeats)}
    big = work / "tpu_large.xplane.pb"
    events = large_xspace(big, int(os.environ.get("TPUDIAG_BENCH_XPLANE_EVENTS", "1000000")))
    out["xplane_large"] = {"events": events, **compare(big, work, max(1, repeats - 1))}
    return out


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tpudiag-bench-xplane-") as tmp:
        return measure(Path(tmp))


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
