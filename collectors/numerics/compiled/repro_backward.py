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

from tpudiag.collectors.numerics.compiled.repro import HEAD, VERDICTS, to_cpu, write_bundle

SCRIPT = (
    '"""Re-run the backward of compiled graph {compile_id} (backend {backend}, {frame}) against float64.\n'
    + HEAD
    + """saved = torch.load(here / "inputs.pt", weights_only=False)
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
"""
    + VERDICTS
)


def write_backward_repro(checker: Any, g: Any) -> str | None:
    failing = g.failing_bw
    if checker.ctx.run_dir is None or failing is None:
        return None
    saved = {
        "inputs": [to_cpu(x) for x in failing["inputs"]],
        "wanted": list(failing["wanted"]),
        "grad_outputs": [to_cpu(x) for x in failing["grad_outputs"]],
    }
    out = write_bundle(checker, g, "-backward", saved, SCRIPT, "input gradient")
    failing["repro"] = out
    return out
