"""torch.compile as users call it: a compiled module trained for a few steps, model.compile(), a compiled function
that calls modules, fullgraph=True, dynamic=True, a graph break inside a module; backends from argv[1]."""

import sys

import _results
import torch
import torch.nn.functional as F

backends = sys.argv[1].split(",") if len(sys.argv) > 1 else ["aot_eager"]
only_modules = "--only-modules" in sys.argv  # compile(model) and model.compile() (Inductor compiles are slow)
torch.manual_seed(0)


def mlp():
    return torch.nn.Sequential(
        *[torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.LayerNorm(16)) for _ in range(2)]
    )


class Breaking(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        x = F.relu(self.a(x))
        print("graph break inside a module")  # Dynamo breaks the graph here
        return self.b(x).sigmoid()


def train(model, call, steps, shapes=((8, 16),)):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        x = torch.randn(*shapes[step % len(shapes)])
        loss = call(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss


for backend in backends:
    m = mlp()
    loss = train(m, torch.compile(m, backend=backend), 6)  # watched steps, then unwatched ones
    _results.add(f"{backend} compile(model)", [loss, _results.params(m)])

    m = mlp()
    m.compile(backend=backend)
    _results.add(f"{backend} model.compile()", [train(m, m, 2), _results.params(m)])

    if only_modules:
        print(backend, "counters", _results.dynamo_counters())
        continue
    m, head = mlp(), torch.nn.Linear(16, 2)
    fn = torch.compile(lambda x: head(m(x)).softmax(-1), backend=backend)  # noqa: B023 (called in this iteration only)
    _results.add(f"{backend} compile(fn)", [fn(torch.randn(4, 16)), fn(torch.randn(4, 16))])

    m = mlp()
    full = torch.compile(m, backend=backend, fullgraph=True)
    _results.add(f"{backend} fullgraph", [train(m, full, 2)])

    m = mlp()
    dyn = torch.compile(m, backend=backend, dynamic=True)
    _results.add(f"{backend} dynamic", [train(m, dyn, 3, shapes=((4, 16), (6, 16), (9, 16)))])

    m = mlp()
    rec = torch.compile(m, backend=backend)
    _results.add(f"{backend} recompile", [train(m, rec, 3, shapes=((4, 16), (6, 16), (9, 16)))])

    b = Breaking()
    _results.add(f"{backend} graph break", [train(b, torch.compile(b, backend=backend), 2)])
    print(backend, "counters", _results.dynamo_counters())
_results.finish()
