"""A steady minute of the long-run bench's step: what each capture mode costs once warm-up is over, with error bars.

``long_run`` answers the issue's question (a whole 10-minute run against plain python), one figure a pair.  Its pairs
move by a few percent between runs on this 2-core VM, more than any one change to the per-step path, so a change
judged on it is judged on noise.  This benchmark is for that judgement: many short pairs, each a plain run beside a
run of one mode (``bench/workloads/steady_loop.py``), both counting steps over the same wall-clock window after a
warm-up, with every thread and child process of both process trees swapped between the two cores every 2 s (each run
sees both cores for the same time: a core faster than the other favours neither).  The capture's helpers (the window
analyst, the store feeder, its threads) go with its tree, so their CPU time is charged to it, as in ``long_run``.

Modes (``BENCH_STEADY_MODES``, comma-separated; default all): ``plain`` (a plain run beside a plain run: the
measure's own spread), ``default`` (``tpudiag capture``), ``trace`` (``--collect trace``: the pulse and the window
plan alone), ``numerics_off`` (the default collectors with ``--numerics off``).  ``BENCH_STEADY_RUNS`` pairs a mode
(default 4, the modes interleaved round by round), ``BENCH_STEADY_S`` seconds counted (default 40) after
``BENCH_STEADY_WARM_S`` (default 20).

Per mode: the steps ratio to the plain run beside it (mean, its standard error, every run), the median-period ratio
(a uniform slowdown of every step), the tails (time in periods over 1.5x the median, beyond it: preemptions by the
capture's helpers, numerics re-checks), and each phase's difference from plain's in microseconds.

Why the error bars matter here: a process of this loop draws a speed for the whole run from where its tensors land
(session 38: in one pair the plain run's backward took 117 us a step more than the capture's beside it for the whole
run; `perf` put the difference in MKL's sgemm kernel), so one pair can read 3-5% either way with nothing of tpudiag's
in it.

    BENCH_STEADY_RUNS=6 BENCH_STEADY_MODES=plain,default python -m bench.run steady_minute
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import last_json_line
from tpudiag import deferred_store
from tpudiag.store import Store, pending

REPO = Path(__file__).resolve().parents[1]
LOOP = REPO / "bench" / "workloads" / "steady_loop.py"
MODES = {
    "plain": None,
    "default": [],
    "trace": ["--collect", "trace"],
    "numerics_off": ["--numerics", "off"],
}
SWAP_S = 2.0


def _command(mode: str, db: Path) -> list[str]:
    args = MODES[mode]
    if args is None:
        return [sys.executable, str(LOOP)]
    return [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), *args, str(LOOP)]


def _tree_tasks(pid: int) -> list[int]:
    """Every thread of ``pid`` and of its descendants (from /proc; a process that just left is skipped)."""
    tasks: list[int] = []
    pending = [pid]
    while pending:
        p = pending.pop()
        try:
            threads = [int(t) for t in os.listdir(f"/proc/{p}/task")]
        except OSError:
            continue
        tasks += threads
        for t in threads:
            try:
                with open(f"/proc/{p}/task/{t}/children") as fh:
                    pending += [int(c) for c in fh.read().split()]
            except OSError:
                pass
    return tasks


def _swap(procs: list[subprocess.Popen[str]], cores: list[int], stop: threading.Event) -> None:
    flip = 0
    while not stop.is_set():
        for i, proc in enumerate(procs):
            core = cores[(i + flip) % 2]
            for task in _tree_tasks(proc.pid):
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(task, {core})
        flip ^= 1
        stop.wait(SWAP_S)


def _pair(mode: str, work: Path, n: int, warm_s: float, seconds: float, cores: list[int]) -> dict[str, Any]:
    t0 = time.time() + warm_s
    env = {**os.environ, "BENCH_T0": repr(t0), "BENCH_T1": repr(t0 + seconds)}
    sides = ("plain", mode)
    outs = [work / f"out{n}-{i}.txt" for i in range(2)]  # (``plain`` beside ``plain``: two files)
    dbs = [work / f"run{n}-{i}.duckdb" for i in range(2)]
    procs: list[subprocess.Popen[str]] = []
    for side, out, db in zip(sides, outs, dbs, strict=True):
        with open(out, "w") as fh:
            cmd = _command(side, db)
            procs.append(subprocess.Popen(cmd, cwd=work, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True))
    stop = threading.Event()
    swapper = threading.Thread(target=_swap, args=(procs, cores, stop), daemon=True)
    swapper.start()
    codes = [p.wait() for p in procs]
    stop.set()
    swapper.join()
    for side, db in zip(sides, dbs, strict=True):
        if MODES[side] is not None:  # the detached store write, before the next pair's warm-up
            pending.settle(Store(db), deferred_store.finish)
    results = []
    for out, code in zip(outs, codes, strict=True):
        text = out.read_text()
        if code != 0:
            raise RuntimeError(f"steady_minute: {out.name} exited {code}: {text[-500:]}")
        results.append(last_json_line(text))
    plain, other = results
    return {
        "steps_ratio": other["steps"] / plain["steps"],
        "median_ratio": plain["median_period_s"] / other["median_period_s"],
        "tail_pct": {"plain": 100 * plain["tail_share"], "measured": 100 * other["tail_share"]},
        "phase_delta_us": {
            k: round(other["phase_median_us"][k] - plain["phase_median_us"][k], 1) for k in plain["phase_median_us"]
        },
    }


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["steps_ratio"] for r in runs]
    sem = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else None
    phases = runs[0]["phase_delta_us"].keys()
    return {
        "steps_ratio_mean": round(statistics.mean(ratios), 4),
        "steps_ratio_sem": None if sem is None else round(sem, 4),
        "steps_ratios": [round(x, 4) for x in ratios],
        "median_ratio_mean": round(statistics.mean(r["median_ratio"] for r in runs), 4),
        "median_ratios": [round(r["median_ratio"], 4) for r in runs],
        "tail_pct_mean": {
            side: round(statistics.mean(r["tail_pct"][side] for r in runs), 2) for side in runs[0]["tail_pct"]
        },
        "phase_delta_us_mean": {k: round(statistics.mean(r["phase_delta_us"][k] for r in runs), 1) for k in phases},
        "phase_delta_us": [r["phase_delta_us"] for r in runs],
    }


def main() -> dict[str, object]:
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        raise SystemExit("steady_minute needs two cores (a plain run beside each measured run)")
    runs_per_mode = int(os.environ.get("BENCH_STEADY_RUNS", "4"))
    seconds = float(os.environ.get("BENCH_STEADY_S", "40"))
    warm_s = float(os.environ.get("BENCH_STEADY_WARM_S", "20"))
    modes = [m for m in os.environ.get("BENCH_STEADY_MODES", ",".join(MODES)).split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"BENCH_STEADY_MODES: unknown mode(s) {', '.join(unknown)} (known: {', '.join(MODES)})")
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        n = 0
        for r in range(runs_per_mode):
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                runs[mode].append(_pair(mode, work, n, warm_s, seconds, cores))
                n += 1
                print(f"steady_minute: {mode} run {r + 1}/{runs_per_mode}: "
                      f"{runs[mode][-1]['steps_ratio']:.4f}", file=sys.stderr, flush=True)  # fmt: skip
    return {
        "seconds_counted": seconds,
        "warm_up_s": warm_s,
        "runs_per_mode": runs_per_mode,
        "layout": f"side_by_side, every task of both trees swapped between two cores every {SWAP_S:g} s",
        "modes": {m: _summary(rs) for m, rs in runs.items()},
    }
