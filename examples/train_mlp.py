"""A small training script: an MLP classifier on synthetic data, a few epochs of SGD.

Run it with tpudiag: ``tpudiag capture examples/train_mlp.py --epochs 2``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.act(self.fc(x)))


class MLP(nn.Module):
    def __init__(self, features: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(torch.relu(self.embed(x))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=128)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = MLP(features=32, width=args.width, depth=3, classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.CrossEntropyLoss()
    data = [(torch.randn(args.batch_size, 32), torch.randint(0, 10, (args.batch_size,))) for _ in range(args.batches)]
    for epoch in range(args.epochs):
        total = 0.0
        for x, y in data:
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item()
        print(f"epoch {epoch}: loss {total / len(data):.4f}")


if __name__ == "__main__":
    main()
