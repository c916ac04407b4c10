"""Benchmark workload: the example MLP's training loop, timed from inside (written to $BENCH_OUT)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from train_mlp import MLP  # type: ignore[import-not-found]


def main() -> None:
    steps = int(os.environ.get("BENCH_STEPS", "60"))
    torch.set_num_threads(1)  # less sensitive to other load on a small machine
    torch.manual_seed(0)
    model = MLP(features=32, width=256, depth=4, classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    for _ in range(3):  # warm-up outside the timed loop
        loss_fn(model(x), y).backward()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    elapsed = time.perf_counter() - t0
    Path(os.environ["BENCH_OUT"]).write_text(f"{elapsed}\n")


if __name__ == "__main__":
    main()
