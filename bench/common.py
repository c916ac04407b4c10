"""Shared helpers for benchmarks: results are JSON files in bench/results/, ratios measured in one run."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = Path(os.environ.get("TPUDIAG_BENCH_RESULTS", BENCH_DIR / "results"))


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    payload = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
        **data,
    }
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"{name}: {json.dumps(data)}")
    return path


def last_json_line(stdout: str) -> dict[str, Any]:
    """The last line of a workload's output that is a JSON object (its result; earlier lines are its chatter)."""
    data: dict[str, Any] = json.loads(next(line for line in reversed(stdout.splitlines()) if line.startswith("{")))
    return data


def timed_runs(fn: Callable[[], Any], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def run_python(args: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> float:
    """Wall time of ``python ARGS`` in a fresh process (raises on failure)."""
    full_env = {**os.environ, **(env or {})}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=cwd, env=full_env, check=True, capture_output=True)
    return time.perf_counter() - t0


def median(values: list[float]) -> float:
    return statistics.median(values)
