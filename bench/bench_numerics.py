"""Numerics collector overhead against the irreducible cost of a CPU float64 oracle, and ``--budget`` honoured.

All in one process, in one run, as ratios:
- ``baseline``: a small transformer-style training loop (fp32, CPU), no mode;
- ``oracle_only``: a minimal dispatch mode that re-runs every op on float64 copies of its inputs and nothing else
  (the work any per-op oracle must do);
- ``oracle_compare``: the same plus one max|out - ref| pass per floating output (the least a comparison costs);
- ``collector``: the numerics mode checking every op (``--numerics all``): metrics, verdicts, shadow stream, rows;
- ``budget``: a real ``tpudiag capture --collect numerics --numerics all --budget 20`` of the same loop (12 steps),
  its whole training loop timed from inside the script against ``--collect none``.

Each configuration runs REPEATS times, interleaved, and the minimum counts (the machine may be shared).

Targets (DESIGN §6): (collector - baseline) / (oracle_only - baseline) <= 1.3; with the budget, the total extra
time <= 20% of the baseline (plus a small measurement allowance).
"""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BUDGET_PCT = 20.0
REPEATS = 5


WORKLOAD = """
import time
import torch


def make(steps=2, d=256, ff=1024, batch=8, seq=64):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=d, nhead=4, dim_feedforward=ff, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(layer, torch.nn.LayerNorm(d), torch.nn.Linear(d, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(batch, seq, d)
    target = torch.randint(0, 64, (batch * seq,))

    def run():
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), target)
            loss.backward()
            opt.step()

    return run


if __name__ == "__main__":
    run = make(steps=12)
    t0 = time.perf_counter()
    run()  # the whole training loop, first step included: the budget covers all of it
    print(f"loop_s={time.perf_counter() - t0:.6f}")
"""


def _workload(steps: int = 2) -> Any:
    namespace: dict[str, Any] = {}
    exec(compile(WORKLOAD, "workload", "exec"), namespace)
    return namespace["make"](steps=steps)


def _oracle_only_mode(compare: bool = False) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    def up(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x.detach().to("cpu", torch.float64 if x.is_floating_point() else x.dtype, copy=True)
        return x

    class OracleOnly(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = kwargs or {}
            a64, k64 = tree_map(up, (args, kwargs))  # copies before the op: in-place ops need them
            out = func(*args, **kwargs)
            if torch.Tag.nondeterministic_seeded not in func.tags:
                with contextlib.suppress(Exception):
                    ref = func(*a64, **k64)
                    if compare and isinstance(out, torch.Tensor) and out.is_floating_point():
                        torch.sub(out, ref).abs().max().item()  # the one pass any comparison needs
            return out

    return OracleOnly()


def _numerics_mode(options: Any, budget: Any = None) -> Any:
    from tpudiag.collectors.numerics.mode import Context, NumericsMode
    from tpudiag.collectors.numerics.records import Recorder

    recorder = Recorder("bench", None)
    return NumericsMode(Context(run_id="bench"), options, recorder, budget), recorder


def _timed(run: Any, mode: Any = None) -> float:
    """Wall seconds of one run (its process CPU seconds are appended to ``_cpu_log``)."""
    t0, c0 = time.perf_counter(), time.process_time()
    if mode is None:
        run()
    else:
        with mode:
            run()
    _cpu_log.append(time.process_time() - c0)
    return time.perf_counter() - t0


_cpu_log: list[float] = []


def _captured_loop_s(script: Path, db: Path, *options: str) -> tuple[float, int]:
    """The workload's own loop time when run under ``tpudiag capture OPTIONS``, and the ops it checked."""
    proc = subprocess.run(
        [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), *options, str(script)],
        capture_output=True,
        text=True,
        check=True,
    )
    match = re.search(r"numerics: \d+ ops seen, (\d+) checked", proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("loop_s="):
            return float(line.split("=", 1)[1]), int(match.group(1)) if match else 0
    raise RuntimeError(f"no loop time in the output: {proc.stdout[-500:]} {proc.stderr[-500:]}")


def main() -> dict[str, Any]:
    from tpudiag.collectors.numerics.sampling import SamplingOptions

    run = _workload()
    run()  # warm up allocator and kernels
    base, oracle, oracle_cmp, collector = [], [], [], []
    cpu: dict[str, list[float]] = {"base": [], "oracle": [], "collector": []}
    checked_all = 0
    for _ in range(REPEATS):  # interleaved, so a busy moment hurts every configuration alike
        base.append(_timed(run))
        cpu["base"].append(_cpu_log[-1])
        oracle.append(_timed(run, _oracle_only_mode()))
        cpu["oracle"].append(_cpu_log[-1])
        oracle_cmp.append(_timed(run, _oracle_only_mode(compare=True)))
        mode, rec = _numerics_mode(SamplingOptions(mode="all"))
        collector.append(_timed(run, mode))
        cpu["collector"].append(_cpu_log[-1])
        checked_all = rec.findings.checked
    cb, co, cc = (min(cpu[k]) for k in ("base", "oracle", "collector"))
    ratio_cpu = (cc - cb) / max(co - cb, 1e-9)
    b, o, c = min(base), min(oracle), min(collector)
    ratio = (c - b) / max(o - b, 1e-9)
    oc = min(oracle_cmp)
    ratio_cmp = (c - b) / max(oc - b, 1e-9)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "workload.py"
        script.write_text(WORKLOAD)
        db = Path(tmp) / "bench.duckdb"
        plain, budgeted = [], []
        checked_budget = 0
        for _ in range(5):
            plain.append(_captured_loop_s(script, db, "--collect", "none")[0])
            loop_s, checked_budget = _captured_loop_s(
                script, db, "--collect", "numerics", "--numerics", "all", "--budget", str(BUDGET_PCT)
            )
            budgeted.append(loop_s)
    p, g = min(plain), min(budgeted)
    overhead_pct = 100.0 * (g - p) / p
    return {
        "baseline_s": round(b, 4),
        "oracle_only_s": round(o, 4),
        "collector_all_s": round(c, 4),
        "ops_checked_all": checked_all,
        "overhead_vs_oracle_ratio": round(ratio, 3),
        "target_overhead_vs_oracle_ratio": 1.3,
        "ratio_met": ratio <= 1.3,
        "oracle_compare_s": round(oc, 4),
        "overhead_vs_oracle_compare_ratio": round(ratio_cmp, 3),
        # The same ratio in process CPU seconds (less sensitive to other processes on a shared machine).
        "overhead_vs_oracle_ratio_cpu": round(ratio_cpu, 3),
        "capture_plain_loop_s": round(p, 4),
        "capture_budget_loop_s": round(g, 4),
        "budget_pct": BUDGET_PCT,
        "budget_overhead_pct": round(overhead_pct, 2),
        "budget_honoured": overhead_pct <= BUDGET_PCT * 1.1,
        "capture_budget_ops_checked": checked_budget,
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
