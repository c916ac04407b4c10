"""torch features real scripts use: activation checkpointing, CPU autocast bf16, a DataLoader with worker
processes, AdamW foreach and fused, scaled_dot_product_attention, torch.library.custom_op, complex, integer,
boolean and sparse tensors, an op error the script catches, and arguments that look like tpudiag's own."""

import sys

import _results
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

print("argv", sys.argv[1:])
torch.manual_seed(0)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.fc2(F.gelu(self.fc1(x))))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(x)


@torch.library.custom_op("tpudiag_test::scaled_add", mutates_args=())
def scaled_add(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    return x + alpha * y


@scaled_add.register_fake
def _(x, y, alpha):
    return torch.empty_like(x)


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(16, generator=g), torch.tensor(i % 4)


if __name__ == "__main__":
    for fused in (False, True):
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
        loader = torch.utils.data.DataLoader(Squares(), batch_size=8, num_workers=2)
        for x, y in loader:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        print("fused", fused, "loss", repr(loss.item()))
        _results.add(f"net fused={fused}", _results.params(net))

    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = Net()(torch.randn(4, 16))
    _results.add("autocast bf16", a)

    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    _results.add("sdpa", F.scaled_dot_product_attention(q, k, v, is_causal=True))
    _results.add("custom_op", scaled_add(torch.randn(3), torch.randn(3), 0.5))

    c = torch.randn(4, 4, dtype=torch.complex64)
    _results.add("complex", [c @ c.conj().T, torch.fft.fft(torch.randn(8)), c.abs()])
    i = torch.randint(-5, 5, (6,))
    _results.add("int", [i * 3 // 2, i.cumsum(0), torch.bincount(i.abs()), i.sort()])
    b = i > 0
    _results.add("bool", [b & ~b.roll(1), b.any(), torch.where(b, i, -i)])
    s = torch.sparse_coo_tensor([[0, 1, 2], [2, 0, 1]], [1.0, 2.0, 3.0], (3, 3))
    _results.add("sparse", [torch.sparse.mm(s, torch.randn(3, 2)), (s + s).coalesce(), s.to_dense()])

    try:
        torch.randn(2, 3) @ torch.randn(4, 5)
    except RuntimeError as err:
        print("caught", type(err).__name__, str(err).splitlines()[0])
    _results.finish()
