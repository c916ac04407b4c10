"""Benchmark workload (bench_steady_minute): the long-run bench's step (tests/long_scripts/long_loop.py's 7-layer MLP,
AdamW, a ``torch.compile``'d function) with no planted anomalies, counted between two wall-clock times given to both
runs of a pair (``BENCH_T0``, ``BENCH_T1``: seconds since the epoch), so both count the same minutes.

Prints one JSON line: the steps that began in the window, the median loop period, the tail (time in loop periods
over 1.5x the median, beyond the median, as a share of the window), and each phase's median in microseconds
(``zero_grad`` + forward, backward, ``opt.step``, the compiled call).
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
from long_step import build  # (this folder: the script's sys.path[0])


def main() -> None:
    t0, t1 = float(os.environ["BENCH_T0"]), float(os.environ["BENCH_T1"])
    torch.set_num_threads(1)
    model, opt, x, static = build()
    clock = time.perf_counter
    periods: list[float] = []
    phases: list[tuple[float, float, float, float]] = []
    steps, last = 0, None
    while True:
        now = time.time()
        if now >= t1:
            break
        counting = now >= t0
        if counting:
            if last is not None:
                periods.append(now - last)
            last = now
            steps += 1
        a0 = clock()
        opt.zero_grad()
        loss = model(x).square().mean()
        a1 = clock()
        loss.backward()
        a2 = clock()
        opt.step()
        a3 = clock()
        static(torch.ones(32, 4))
        a4 = clock()
        if counting:
            phases.append((a1 - a0, a2 - a1, a3 - a2, a4 - a3))
    if not periods:
        raise SystemExit("steady_loop: no step in the measured window (BENCH_T0/BENCH_T1)")
    med = statistics.median(periods)
    tail = sum(p - med for p in periods if p > 1.5 * med)
    names = ("forward", "backward", "opt_step", "compiled_call")
    columns = zip(*phases, strict=True)
    result = {
        "steps": steps,
        "median_period_s": med,
        "tail_share": tail / sum(periods),
        "phase_median_us": {
            name: round(statistics.median(col) * 1e6, 1) for name, col in zip(names, columns, strict=True)
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
