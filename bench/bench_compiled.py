"""Compiled-region checking: its cost against the graph's float64 oracle alone, and ``--budget`` on a compiled loop.

All in one process, in one run, as ratios (aot_eager: a real AOTAutograd compile whose kernels are cheap to build):
- ``plain``: a compiled transformer-layer training step, no checker;
- ``oracle_only``: the irreducible work of any graph oracle, per step: copy the graph inputs to float64 on the CPU,
  run the float64 graph forward with grad, and its backward VJP (what a forward+backward check must compute);
- ``checked``: the same steps with the compiled-region checker checking every call (``--numerics all``): input
  snapshot, float64 and eager replays, verdicts, the backward hook with both VJPs, rows;
- ``budget``: the checker in its default sampling with ``--budget 20`` over a 30-step loop, against the plain loop.

Each configuration runs REPEATS times, interleaved, the minimum counts (the machine may be shared).
Targets (DESIGN §6): (checked - plain) / oracle_only <= 1.3; the budgeted loop's extra time <= 20% of plain.
"""

from __future__ import annotations

import time
from typing import Any

BUDGET_PCT = 20.0
REPEATS = 5
STEPS = 3
LOOP_STEPS = 20


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, dropout=0.0, batch_first=True)
    model = torch.nn.Sequential(layer, torch.nn.LayerNorm(128), torch.nn.Linear(128, 32))
    return model, torch.randn(8, 32, 128)


def _checker(options: Any, budget: Any) -> Any:
    from tpudiag.collectors.numerics.compiled.checker import CheckerContext, CompiledChecker
    from tpudiag.collectors.numerics.records import Recorder

    seq = [0]

    def next_seq() -> int:
        seq[0] += 1
        return seq[0]

    return CompiledChecker(
        CheckerContext("bench", Recorder("bench", None), options, budget, time.perf_counter(), next_seq)
    )


def _steps(compiled: Any, x: Any, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        compiled(x).pow(2).mean().backward()
    return time.perf_counter() - t0


def main() -> dict[str, Any]:
    import torch

    from tpudiag.collectors.numerics.sampling import Budget, SamplingOptions
    from tpudiag.oracle import graph as graph_oracle

    model, x = _model()
    checker = _checker(SamplingOptions(mode="all"), Budget(None))
    checker.start()
    compiled = torch.compile(model, backend="aot_eager")
    captured: list[Any] = []
    real_call = checker._checked_call

    def spy(g: Any, fn: Any, args: Any, plan: Any) -> Any:
        captured.append(args)  # the graph's real inputs (parameters and x, in the graph's order)
        return real_call(g, fn, args, plan)

    checker._checked_call = spy
    _steps(compiled, x, 2)  # compile (graph captured) and warm up
    checker._checked_call = real_call
    (g,) = checker.graphs
    args = list(captured[-1])

    def oracle_step() -> None:
        inputs = graph_oracle.float64_inputs(args)
        wanted = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
        for t, w in zip(inputs, wanted, strict=True):
            if w:
                t.requires_grad_(True)
        out = graph_oracle.replay(g.fp64, inputs, grad=True).outputs[0]
        leaves = [t for t, w in zip(inputs, wanted, strict=True) if w]
        torch.autograd.grad(out, leaves, torch.ones_like(out))

    plain, checked, oracle = [], [], []
    for _ in range(REPEATS):
        checker.active = False
        plain.append(_steps(compiled, x, STEPS))
        checker.active = True
        checked.append(_steps(compiled, x, STEPS))
        t0 = time.perf_counter()
        for _ in range(STEPS):
            oracle_step()
        oracle.append(time.perf_counter() - t0)
    summary = checker.stop()
    p, c, o = min(plain), min(checked), min(oracle)
    ratio = (c - p) / max(o, 1e-9)

    # --budget 20 with the default sampling, on a longer loop (fresh compile, fresh checker).
    torch._dynamo.reset()
    model2, x2 = _model()
    budgeted = _checker(SamplingOptions(budget_pct=BUDGET_PCT), Budget(BUDGET_PCT))
    budgeted.start()
    compiled2 = torch.compile(model2, backend="aot_eager")
    _steps(compiled2, x2, 1)
    loop_plain, loop_budget = [], []
    for _ in range(3):  # interleaved; each budgeted loop starts a fresh budget whose allowance grows with it alone
        budgeted.active = False
        loop_plain.append(_steps(compiled2, x2, LOOP_STEPS))
        budgeted.ctx.budget = Budget(BUDGET_PCT)
        budgeted.ctx.started = time.perf_counter()
        budgeted.active = True
        loop_budget.append(_steps(compiled2, x2, LOOP_STEPS))
    bsum = budgeted.stop()
    lp, lb = min(loop_plain), min(loop_budget)
    overhead_pct = 100.0 * (lb - lp) / lp
    return {
        "plain_s": round(p, 4),
        "checked_all_s": round(c, 4),
        "oracle_only_s": round(o, 4),
        "graph_checks": summary["graph_checks"],
        "backward_checks": summary["backward_checks"],
        "check_vs_oracle_ratio": round(ratio, 3),
        "target_check_vs_oracle_ratio": 1.3,
        "ratio_met": ratio <= 1.3,
        "loop_plain_s": round(lp, 4),
        "loop_budget_s": round(lb, 4),
        "budget_pct": BUDGET_PCT,
        "budget_overhead_pct": round(overhead_pct, 2),
        "budget_honoured": overhead_pct <= BUDGET_PCT * 1.1,
        "budget_graph_checks": bsum["graph_checks"],
    }


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=2))
