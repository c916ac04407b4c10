"""Overhead of the compile collector on a script that compiles and runs a small model (target: <= 5%).

Each measurement is a fresh process running the same workload: a small MLP under ``torch.compile``, trained
for some steps on two batch sizes (so it recompiles once), with a warm Inductor cache (the case where
compiling is shortest and the structured-trace handler weighs most).  ``baseline`` runs the workload alone;
``collector`` runs it with the compile collector started before and stopped (events spooled to Parquet) after
it, as a capture does; ``torch_trace`` runs it with torch's own TORCH_TRACE file logging, for reference.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from bench.common import median, run_python

REPEATS = int(os.environ.get("TPUDIAG_BENCH_REPEATS", "3"))

WORKLOAD = textwrap.dedent(
    """
    import json, os, sys, time
    t0 = time.perf_counter()
    collector = None
    if os.environ.get("BENCH_COLLECT") == "1":
        from pathlib import Path
        from tpudiag.collectors.compile import CompileCollector
        from tpudiag.plugins import CaptureContext
        from tpudiag.spool import Spool
        run_dir = Path(sys.argv[2])
        ctx = CaptureContext(run_id="bench", run_dir=run_dir, spool=Spool(run_dir / "spool"))
        collector = CompileCollector()
        collector.prepare(ctx)
        collector.start(ctx)
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = torch.compile(model)
    for batch in (32, 64):
        for _ in range(100):
            loss = step(torch.randn(batch, 64)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
    events = 0
    if collector is not None:
        collector.stop()
        import pyarrow.parquet as pq
        parts = sorted((run_dir / "spool" / "compile_events").glob("*.parquet"))
        events = sum(pq.read_metadata(p).num_rows for p in parts)
    with open(sys.argv[1], "w") as fh:
        json.dump({"seconds": time.perf_counter() - t0, "events": events}, fh)
    """
)


def _run(work: Path, mode: str, index: int) -> dict[str, Any]:
    out = work / f"{mode}-{index}.json"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor"), "PYTHONPATH": str(Path(__file__).parents[1])}
    if mode == "collector":
        env["BENCH_COLLECT"] = "1"
    if mode == "torch_trace":
        env["TORCH_TRACE"] = str(work / f"trace-{index}")
    run_python([str(work / "workload.py"), str(out), str(work / f"run-{index}")], env=env)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tpudiag-bench-compile-") as tmp:
        work = Path(tmp)
        (work / "workload.py").write_text(WORKLOAD)
        user_trace = os.environ.pop("TORCH_TRACE", None)  # the baseline must not log to files
        try:
            _run(work, "baseline", -1)  # warm the Inductor cache
            times: dict[str, list[float]] = {"baseline": [], "collector": [], "torch_trace": []}
            events = 0
            for i in range(REPEATS):
                for mode in times:  # interleaved, so drift hits every mode alike
                    r = _run(work, mode, i)
                    times[mode].append(r["seconds"])
                    events = max(events, int(r["events"]))
        finally:
            if user_trace is not None:
                os.environ["TORCH_TRACE"] = user_trace
    base = median(times["baseline"])
    return {
        "baseline_s": round(base, 3),
        "collector_s": round(median(times["collector"]), 3),
        "torch_trace_s": round(median(times["torch_trace"]), 3),
        "collector_overhead": round(median(times["collector"]) / base - 1, 4),
        "torch_trace_overhead": round(median(times["torch_trace"]) / base - 1, 4),
        "events": events,
        "repeats": REPEATS,
        "target_overhead": 0.05,
    }


if __name__ == "__main__":
    print(json.dumps(main()), file=sys.stdout)
