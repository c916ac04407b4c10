"""A runnable bundle per failing compiled graph: the graph's code, its inputs, and ``repro.py``.

    python repro.py [--backend inductor|aot_eager|eager|tpu] [--device cpu|cuda|tpu]

compiles the graph with the chosen backend, runs it on the chosen device, replays it on the CPU in float64 and
eagerly at the same dtype, and prints each output's RMSE against float64 and the verdict (the same rule as the
capture).  The bundle lives in ``<run>/numerics/repro/graph-<compile id>/``.
"""

from __future__ import annotations

import textwrap
from typing import Any

import torch

# The parts every bundle's repro.py shares: arguments and the graph (HEAD), then verdicts over (out, eager, fp64),
# one line per ``{label}`` (VERDICTS).  Each bundle puts its docstring title first and its own run between.
HEAD = '''
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
'''
VERDICTS = """worst = "pass"
for i, (c, e, r) in enumerate(zip(out, eager, fp64)):
    ck = check_output(c, e, r)
    if ck is None:
        continue
    print(f"{label} {{i}}: {{ck.dtype}} {{ck.numel}} elements: RMSE compiled-fp64 {{ck.rmse:.4g}}, "
          f"eager-fp64 {{ck.ref_rmse:.4g}} -> {{ck.verdict.verdict}}")
    if ck.verdict.verdict != "pass":
        worst = ck.verdict.verdict
print(f"verdict: {{worst}}")
"""
SCRIPT = (
    '"""Re-run compiled graph {compile_id} (backend {backend}, {frame}) and compare it with float64.\n'
    + HEAD
    + """inputs = torch.load(here / "inputs.pt", weights_only=False)
device_inputs = [x.to(opts.device) if isinstance(x, torch.Tensor) else x for x in inputs]
gm = torch.fx.symbolic_trace(namespace["Repro"]())
compiled = torch.compile(namespace["Repro"](), backend=opts.backend)
out = graph_oracle.flat_outputs(compiled(*graph_oracle.clone_inputs(device_inputs)))
fp64 = graph_oracle.replay(graph_oracle.to_float64_graph(gm), graph_oracle.float64_inputs(inputs)).outputs
eager = graph_oracle.replay(gm, graph_oracle.clone_inputs(device_inputs)).outputs
"""
    + VERDICTS
)

_BACKENDS = {"inductor", "aot_eager", "eager", "tpu", "aot_eager_decomp_partition", "cudagraphs"}


def graph_source(gm: Any) -> str:
    """``class Repro(torch.nn.Module)`` with the graph's forward (Dynamo graphs hold no submodules: parameters
    are inputs)."""
    return (
        "import torch\nfrom torch import device\n\n\nclass Repro(torch.nn.Module):\n"
        + textwrap.indent(gm.code.strip("\n"), "    ")
        + "\n"
    )


def to_cpu(x: Any) -> Any:
    return x.detach().to("cpu") if isinstance(x, torch.Tensor) else x


def write_bundle(checker: Any, g: Any, suffix: str, saved: Any, script: str, label: str) -> str:
    """``<run>/numerics/repro/graph-<compile id><suffix>/`` with graph.py, ``saved`` as inputs.pt and repro.py
    (``script`` formatted for this graph, its verdict lines naming each ``label``)."""
    out = checker.ctx.run_dir / "numerics" / "repro" / f"graph-{g.info.compile_id.replace('/', '_')}{suffix}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "graph.py").write_text(graph_source(g.info.ref))
    torch.save(saved, out / "inputs.pt")
    backend = g.info.backend if g.info.backend in _BACKENDS else "aot_eager"
    (out / "repro.py").write_text(
        script.format(
            compile_id=g.info.compile_id, backend=g.info.backend, frame=g.info.frame, backend_arg=backend, label=label
        )
    )
    return str(out)


def write_repro(checker: Any, g: Any) -> str | None:
    if checker.ctx.run_dir is None or g.failing is None:
        return None
    out = write_bundle(checker, g, "", [to_cpu(x) for x in g.failing["inputs"]], SCRIPT, "output")
    g.failing["repro"] = out
    return out
