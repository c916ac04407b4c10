"""The long-run bench's training step, built in one place for the benchmarks that time it (``bench_step_hooks`` in
its own process, ``steady_loop.py`` as a script): tests/long_scripts/long_loop.py's 7-layer MLP (width 128), AdamW,
and a ``torch.compile``'d function with static shapes."""

from __future__ import annotations

from typing import Any


def build() -> tuple[Any, Any, Any, Any]:
    """``(model, optimizer, input, compiled function)``, seeded."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(7):
        layers += [nn.Linear(128, 128), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(32, 128)
    static = torch.compile(lambda t: t * 2 + 1, backend="eager", dynamic=False)
    return model, opt, x, static
