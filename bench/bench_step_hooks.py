"""What tpudiag's per-step hooks cost a fast training step, measured so that a noisy machine cancels out (issue 21).

The whole-run benchmark (bench_long_run.py) runs plain python and the capture one after the other, and on a shared
2-core VM the plain loop's own speed moves by 15-60% between runs minutes apart: its ratio cannot resolve a few
percent.  Here one process runs the long-run bench's step (7-layer MLP, AdamW, a compiled function) inside one
``tpudiag.capture()`` and alternates blocks of ``K`` steps with the capture's per-step hooks in place and blocks with
them taken out, for ``BLOCKS`` blocks.  Out means as without tpudiag: torch's global optimizer post-hooks emptied,
and the ``module_calls`` wrapper itself taken off (``nn.Module.__call__`` torch's own again, or the root classes'
wrappers removed in its class mode), so its frames on module calls are counted in the hooks' cost.  Each block gives
the mean main-thread CPU time of its steps (the mean, not the median: most steps of a block are steady, and the
few full steps among them, where the collectors take the steady ones in a batch, are part of the cost: see
``collectors/steady_steps.py``); blocks with a trace window open are left out (windows are the whole-run
benchmark's business).  A block is 100 steps (~0.5 s on the slow VM), all of them counted: full steps come by the
clock (a reading every 0.5 s, ``tpudiag.longrun.stride``), and a block holds about the share of them a run has, or
a little more (one falls due during each off block).  Before session 28 a block was 20 steps with its first two
left out: the reading that fell due during the off block was on one of them, so most full steps went uncounted.
Neighbouring blocks see the same machine, so the median over neighbouring pairs of the on-block minus the off-block
is the hooks' cost per step, and its share of the off median is the figure to hold to the issue's 1%.

    python -m bench.run step_hooks         # BENCH_HOOKS_ROUNDS captures of each kind (default 3)

Three kinds of capture, alternated: the default collectors (every per-step hook), ``--collect trace`` alone (the
pulse, the window plan and the root-call tracker: the issue's "the pulse costs at most 1%"), and the default
collectors on the same model served (its forward under ``no_grad``, no optimizer: each root call is a step,
``collectors/root_steps.py``).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

K = 100
BLOCKS = int(os.environ.get("BENCH_HOOKS_BLOCKS", 60))
ROUNDS = int(os.environ.get("BENCH_HOOKS_ROUNDS", 3))
WARM_STEPS = 2000  # past the first window's steps and the numerics warm-up
TARGET_PCT = 1.0


def _round(db: Path, collect: str | None = None, serving: bool = False) -> dict[str, float]:
    import torch
    from torch.optim import optimizer as optimizer_module

    import tpudiag
    from bench.workloads.long_step import build
    from tpudiag.collectors import module_calls

    model, opt, x, static = build()
    ones = torch.ones(32, 4)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        static(ones)

    def serve() -> None:  # a job without an optimizer step: each root call is a step (collectors/root_steps.py)
        with torch.no_grad():
            model(x)

    if serving:
        step = serve

    hooks = optimizer_module._global_optimizer_post_hooks
    pairs: list[tuple[float, float]] = []  # (on block, the off block after it), neither in a window
    class_blocks = 0
    with tpudiag.capture(db=db, name="step-hooks", collect=collect):
        for _ in range(WARM_STEPS):
            step()
        on_mean: float | None = None
        for block in range(BLOCKS):
            hooked = block % 2 == 0
            if not hooked:  # taken out for this block only, and put back as they were
                saved = dict(hooks)
                hooks.clear()
                wrapped = _take_off(module_calls)
            times = []
            for _ in range(K):
                t0 = time.thread_time_ns()
                step()
                times.append(time.thread_time_ns() - t0)
            if not hooked:
                hooks.update(saved)
                _put_back(module_calls, wrapped)
            mean = statistics.fmean(times) if not torch._C._autograd._profiler_enabled() else None
            if hooked:
                on_mean = mean
                class_blocks += module_calls.class_mode()
            elif on_mean is not None and mean is not None:
                pairs.append((on_mean, mean))
    m_on, m_off = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    paired = statistics.median(p[0] - p[1] for p in pairs)
    return {
        "on_us": m_on / 1e3,
        "off_us": m_off / 1e3,
        "hooks_us": paired / 1e3,
        "blocks": 2 * len(pairs),
        "class_mode_share": class_blocks / max(BLOCKS // 2, 1),
    }


def _take_off(module_calls: Any) -> list[type[Any]] | None:
    """The wrapper off every module call: the classes that carry it (class mode), else nn.Module's."""
    import torch

    if module_calls.class_mode():
        classes = [c for c in module_calls._patched if c.__dict__.get("__call__") is module_calls._call]
        for cls in classes:
            delattr(cls, "__call__")
        return classes
    torch.nn.Module.__call__ = module_calls._original
    return None


def _put_back(module_calls: Any, classes: list[type[Any]] | None) -> None:
    import torch

    if classes is None:
        torch.nn.Module.__call__ = module_calls._call
        return
    for cls in classes:
        cls.__call__ = module_calls._call


def _summary(rounds: list[dict[str, float]]) -> dict[str, Any]:
    pcts = [100 * r["hooks_us"] / r["off_us"] for r in rounds]
    return {
        "rounds": [{k: round(v, 2 if k == "class_mode_share" else 1) for k, v in r.items()} for r in rounds],
        "step_cpu_us": round(statistics.median(r["off_us"] for r in rounds), 1),
        "hooks_us_per_step": round(statistics.median(r["hooks_us"] for r in rounds), 1),
        "hooks_pct_of_step": round(statistics.median(pcts), 2),
        "hooks_pct_per_round": [round(p, 2) for p in pcts],
    }


def main() -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("TPUDIAG_SLOW_FACTOR", "1000")  # the off blocks' gaps are no slow steps
    every: list[dict[str, float]] = []
    pulse: list[dict[str, float]] = []
    serving: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in range(ROUNDS):  # the kinds of capture alternate, so all see the same hour of the machine
            every.append(_round(Path(tmp) / f"hooks{n}.duckdb"))
            pulse.append(_round(Path(tmp) / f"pulse{n}.duckdb", collect="trace"))
            serving.append(_round(Path(tmp) / f"serving{n}.duckdb", serving=True))
    return {
        "steps_per_block": K,
        "blocks_per_round": BLOCKS,
        **_summary(every),
        # The trace collector alone: the pulse, the window plan and the root-call tracker (issue 21's "the pulse
        # costs at most 1%"); the default capture adds the numerics and memory collectors' step hooks.
        "pulse_only": _summary(pulse),
        # The same model served: its forward alone under no_grad, no optimizer, so every root call is a step (the
        # default capture; out: the module-call wrapper off, which makes these steps).
        "serving": _summary(serving),
        "target_pct": TARGET_PCT,
        "note": "main-thread CPU time per step, hooks in vs out (out: no optimizer hooks and torch's own module "
        "__call__) in alternating blocks of one capture (no windows), the median of neighbouring on-off pairs; "
        "top level: the default capture; pulse_only: --collect trace",
    }
