"""A runnable bundle per compiled graph whose backward fails: the graph's code, its inputs, the output gradients
the script's backward fed it, and ``repro.py``.

    python repro.py [--backend inductor|aot_eager|eager|tpu] [--device cpu|cuda|tpu]

compiles the graph with the chosen backend, runs forward and backward on the chosen device with the saved output
gradients, computes the same vector-Jacobian product through the float64 replay and eagerly at the same dtype, and
prints each input gradient's RMSE against float64 and the verdict (the same rule as the capture).  The bundle lives
in ``<run>/numerics/repro/graph-<compile id>-backward/``.
"""

from __future__ import annotations

from typing import Any

import torch

from tpudiag.collectors.numerics.compiled.repro import _BACKENDS, graph_source

SCRIPT = '''"""Re-run the backward of compiled graph {compile_id} (backend {backend}, {frame}) against float64.

    python repro.py [--backend {backend_arg}] [--device cpu|cuda|tpu]
"""

import argparse
import pathlib

import torch

from tpudiag.oracle.outputs import check_output
from tpudiag.oracle import graph as graph_oracle

here = pathlib.Path(__file__).parent
parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="{backend_arg}")
parser.add_argument("--device", default="cpu")
opts = parser.parse_args()
namespace = {{}}
exec((here / "graph.py").read_text(), namespace)
saved = torch.load(here / "inputs.pt", weights_only=False)
inputs, wanted, grads = saved["inputs"], saved["wanted"], saved["grad_outputs"]


def vjp(fn, args, dtype=None):
    args = [x.detach().clone().requires_grad_(True) if w else x for x, w in zip(args, wanted)]
    with torch.enable_grad():
        outs = graph_oracle.flat_outputs(fn(*args))
        pairs = [(o, g.to(o.device, dtype or o.dtype)) for o, g in zip(outs, grads)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        leaves = [x for x, w in zip(args, wanted) if w]
        got = torch.autograd.grad([p[0] for p in pairs], leaves, [p[1] for p in pairs], allow_unused=True)
    return list(got)


device_inputs = [x.to(opts.device) if isinstance(x, torch.Tensor) else x for x in inputs]
gm = torch.fx.symbolic_trace(namespace["Repro"]())
compiled = torch.compile(namespace["Repro"](), backend=opts.backend)
out = vjp(compiled, graph_oracle.clone_inputs(device_inputs))
fp64 = vjp(graph_oracle.to_float64_graph(gm), graph_oracle.float64_inputs(inputs), torch.float64)
eager = vjp(gm, graph_oracle.clone_inputs(device_inputs))
worst = "pass"
for i, (c, e, r) in enumerate(zip(out, eager, fp64)):
    ck = check_output(c, e, r) if c is not None and r is not None else None
    if ck is None:
        continue
    print(f"input gradient {{i}}: {{ck.dtype}} {{ck.numel}} elements: RMSE compiled-fp64 {{ck.rmse:.4g}}, "
          f"eager-fp64 {{ck.ref_rmse:.4g}} -> {{ck.verdict.verdict}}")
    if ck.verdict.verdict != "pass":
        worst = ck.verdict.verdict
print(f"verdict: {{worst}}")
'''


def write_backward_repro(checker: Any, g: Any) -> str | None:
    failing = g.failing_bw
    if checker.ctx.run_dir is None or failing is None:
        return None
    name = f"graph-{g.info.compile_id.replace('/', '_')}-backward"
    out = checker.ctx.run_dir / "numerics" / "repro" / name
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph.py").write_text(graph_source(g.info.ref))

    def cpu(x: Any) -> Any:
        return x.detach().to("cpu") if isinstance(x, torch.Tensor) else x

    saved = {
        "inputs": [cpu(x) for x in failing["inputs"]],
        "wanted": list(failing["wanted"]),
        "grad_outputs": [cpu(x) for x in failing["grad_outputs"]],
    }
    torch.save(saved, out / "inputs.pt")
    backend = g.info.backend if g.info.backend in _BACKENDS else "aot_eager"
    (out / "repro.py").write_text(
        SCRIPT.format(compile_id=g.info.compile_id, backend=g.info.backend, frame=g.info.frame, backend_arg=backend)
    )
    failing["repro"] = str(out)
    return str(out)
