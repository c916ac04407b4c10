"""A small conv + MLP training script that, when it runs under tpudiag, breaks tpudiag's own code in every place
that runs inside the script: the numerics mode (the FLOPs of convolutions, the oracle of additions), the module
tracker, the optimizer step hook and the compile collector's log handler.  Under plain Python nothing is broken.
The capture must still behave exactly as plain Python."""

import sys

import _results
import torch


def sabotage():
    from tpudiag.analysis import compile_events
    from tpudiag.collectors import modules
    from tpudiag.collectors.numerics import collector, mode

    flops = mode._flops

    def broken_flops(func, *args, **kwargs):
        if "convolution" in str(func):
            raise TypeError("unhashable type: 'list'")
        return flops(func, *args, **kwargs)

    mode._flops = broken_flops
    compare = mode.NumericsMode._compare

    def broken_compare(self, func, *args, **kwargs):
        if "add" in str(func):
            raise ValueError("sabotaged oracle")
        return compare(self, func, *args, **kwargs)

    mode.NumericsMode._compare = broken_compare
    path_of = modules.ModuleTracker.path_of

    def broken_path_of(self, module):
        if isinstance(module, torch.nn.ReLU):
            raise KeyError("sabotaged tracker")
        return path_of(self, module)

    modules.ModuleTracker.path_of = broken_path_of

    def broken_boundary(self):
        raise RuntimeError("sabotaged step boundary")

    collector.NumericsCollector._boundary = broken_boundary

    def broken_feed(self, *args, **kwargs):
        raise AttributeError("sabotaged compile record")

    compile_events.CompileEventBuilder.feed = broken_feed


if "tpudiag.collectors.numerics.mode" in sys.modules:
    sabotage()

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, 4, 3, padding=[1, 1], stride=[1, 1]), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 2)
)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
step = torch.compile(lambda x: model(x).sum(), backend="eager")
for i in range(3):
    x = torch.randn(2, 3, 4, 4)
    loss = model(x).square().mean() + 0.0 * step(x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("loss", i, repr(loss.item()))
_results.add("params", _results.params(model))
_results.finish()
