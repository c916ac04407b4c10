"""Replay a captured FX graph (one torch.compile region, as Dynamo produced it) as a CPU float64 oracle.

The graph copy is rewritten so that it computes in float64 on the CPU whatever the script asked for: floating
dtype constants (``.to(torch.bfloat16)``, ``dtype=`` keywords, ``.half()``/``.float()``/``.bfloat16()``) become
float64, device constants become the CPU, autocast regions are switched off.  Inputs are copied (floating ones to
float64); the user's tensors are only read.  ``replay`` also says which aten ops ran (random ones make a graph
unverifiable) and, with ``per_node=True``, the value of every node (localisation).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.utils._python_dispatch import TorchDispatchMode

_FLOAT_METHODS = {"half": "double", "float": "double", "bfloat16": "double"}
_AUTOCAST_ENTER = "_enter_autocast"
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "_dtensor", "c10d")


def _is_float_dtype(x: Any) -> bool:
    return isinstance(x, torch.dtype) and x.is_floating_point and x != torch.float64


def _is_device(x: Any) -> bool:
    if isinstance(x, torch.device):
        return x.type != "cpu"
    return isinstance(x, str) and x.split(":")[0] in ("cuda", "tpu", "xla", "mps", "xpu", "privateuseone")


def _rewrite_arg(x: Any, device: bool) -> Any:
    if _is_float_dtype(x):
        return torch.float64
    if device and _is_device(x):
        return torch.device("cpu")
    if isinstance(x, (list, tuple)):
        return type(x)(_rewrite_arg(y, device) for y in x)
    return x


def to_float64_graph(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A float64/CPU copy of ``gm`` (``gm`` itself is left as it is)."""
    out = copy.deepcopy(gm)
    for node in out.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        target_name = getattr(node.target, "__name__", str(node.target))
        if node.op == "call_method" and node.target in _FLOAT_METHODS:
            node.target = _FLOAT_METHODS[node.target]
        if target_name == _AUTOCAST_ENTER and len(node.args) >= 3:
            # _enter_autocast(device_type, dtype, enabled, cache_enabled): keep the pairing, disable the region.
            args = list(node.args)
            args[0], args[2] = "cpu", False
            node.args = tuple(args)
            continue
        node.args = tuple(_rewrite_arg(a, True) for a in node.args)
        node.kwargs = {k: _rewrite_arg(v, True) for k, v in node.kwargs.items()}
    out.recompile()
    return out


def float64_inputs(inputs: Sequence[Any]) -> list[Any]:
    """CPU copies of the graph inputs, floating tensors in float64 (never the user's storage)."""
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            dtype = torch.float64 if (t.is_floating_point() and t.dtype != torch.float64) else t.dtype
            out.append(t.to("cpu", dtype=dtype, copy=True))
        else:
            out.append(x)
    return out


def clone_inputs(inputs: Sequence[Any], device: str | None = None) -> list[Any]:
    """Detached clones of the graph inputs at their own dtype (on ``device`` when given), so a graph that mutates
    its inputs (batch-norm statistics) mutates the clones only."""
    out: list[Any] = []
    for x in inputs:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            out.append(t.to(device, copy=True) if device is not None else t.clone())
        else:
            out.append(x)
    return out


def flat_outputs(out: Any) -> list[Any]:
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(out)
    return list(leaves)


def collectives(gm: torch.fx.GraphModule) -> list[str]:
    """Names of the nodes that call a collective (no CPU oracle for those)."""
    found: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        module = getattr(node.target, "__module__", "") or ""
        ns = getattr(node.target, "namespace", "") or ""
        if ns in COLLECTIVE_NAMESPACES or "distributed" in module:
            found.append(node.name)
    return found


_VIEWS = {
    "view", "reshape", "select", "narrow", "__getitem__", "getitem", "t", "transpose", "permute", "expand",
    "unsqueeze", "squeeze", "as_strided", "detach", "flatten", "unflatten", "view_as", "movedim", "unbind", "split",
    "chunk",
}  # fmt: skip


def _target_name(node: torch.fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    schema = getattr(target, "_schema", None)
    if schema is not None:
        return str(schema.name).split("::")[-1]
    return str(getattr(target, "__name__", target))


def _writes(node: torch.fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is not None:
        return bool(schema.is_mutable)
    name = _target_name(node)
    return (name.endswith("_") and not name.endswith("__")) or name == "setitem" or "out" in node.kwargs


def mutated_attributes(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's attribute tensors (``get_attr``: state Dynamo reached outside the call's inputs, as a compiled
    optimizer step's parameters and its moments) that the graph writes in place, directly or through a view.

    Such a graph cannot be replayed from its call's inputs: its state is not among them (a float64 copy would hold
    the values of the first check, stale by the next step), and a reference replay of the graph itself would write
    the script's own tensors a second time."""
    aliases = {n: str(n.target) for n in gm.graph.nodes if n.op == "get_attr"}  # node -> the attribute it is
    if not aliases:
        return []
    found: list[str] = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method") or not node.args:
            continue
        first = node.args[0]
        targets = first if isinstance(first, (list, tuple)) else [first]
        hit = [aliases[t] for t in targets if isinstance(t, torch.fx.Node) and t in aliases]
        if not hit:
            continue
        if _writes(node):
            found += [name for name in hit if name not in found]
        elif _target_name(node) in _VIEWS and len(hit) == 1:
            aliases[node] = hit[0]
    return found


@dataclass
class Replay:
    """What one replay of a graph produced."""

    outputs: list[Any]
    random_ops: list[str] = field(default_factory=list)  # aten ops tagged nondeterministic_seeded that ran
    node_values: dict[str, Any] = field(default_factory=dict)  # node name -> value (per_node=True)
    node_ops: dict[str, list[str]] = field(default_factory=dict)  # node name -> aten ops it ran (per_node=True)


def _no_randomness(func: Any, args: Any, kwargs: Any) -> bool:
    """A seeded op whose dropout probability is 0 (dropout, attention kernels with ``dropout_p``): configs that turn
    dropout off keep these ops in training graphs, and every mask they draw is all ones."""
    try:
        for i, arg in enumerate(func._schema.arguments):
            if arg.name in ("p", "dropout_p"):
                if arg.name in (kwargs or {}):
                    value = kwargs[arg.name]
                elif i < len(args):
                    value = args[i]
                else:
                    value = arg.default_value
                return bool(value == 0)
    except Exception:
        return False
    return False


class _OpLog(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes the aten ops a replay runs: random ones always, all of them per node when asked."""

    def __init__(self, per_node: bool) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.per_node = per_node
        self.node: str | None = None
        self.random: list[str] = []
        self.ops: dict[str, list[str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) and not _no_randomness(func, args, kwargs):
            self.random.append(str(func))
        if self.per_node and self.node is not None:
            names = self.ops.setdefault(self.node, [])
            if len(names) < 8:
                names.append(str(func))
        return func(*args, **(kwargs or {}))


class _Recording(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule, log: _OpLog, keep: Callable[[torch.fx.Node], bool]) -> None:
        super().__init__(gm)
        self.log = log
        self.keep = keep
        self.values: dict[str, Any] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.log.node = n.name
        value = super().run_node(n)
        self.log.node = None
        if self.keep(n):
            self.values[n.name] = value
        return value


def replay(
    gm: torch.fx.GraphModule,
    inputs: Sequence[Any],
    per_node: bool = False,
    keep: Callable[[torch.fx.Node], bool] | None = None,
    grad: bool = False,
) -> Replay:
    """Run ``gm`` on ``inputs`` (already prepared: float64 copies or clones) with the user's dispatch modes
    suspended (a checker's replay is not the script's work) and the RNG state left as it was; with no grad unless
    ``grad`` (then the outputs keep their autograd graph, for a reference backward)."""
    from torch.utils._python_dispatch import _disable_current_modes

    log = _OpLog(per_node)
    grad_mode = torch.enable_grad() if grad else torch.no_grad()
    with _disable_current_modes(), grad_mode, preserved_rng(), log:
        if per_node:
            interp = _Recording(gm, log, keep or (lambda n: n.op != "output"))
            out = interp.run(*inputs)
            values = interp.values
        else:
            out = gm(*inputs)
            values = {}
    return Replay(flat_outputs(out), log.random, values, log.ops)


class preserved_rng:  # used as a context manager: named like one
    """Save the CPU (and CUDA, when initialised) RNG state on entry and put it back on exit."""

    def __enter__(self) -> None:
        self._cpu = torch.get_rng_state()
        self._cuda: list[torch.Tensor] | None = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            self._cuda = torch.cuda.get_rng_state_all()

    def __exit__(self, *exc: object) -> None:
        torch.set_rng_state(self._cpu)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The nodes that compute something, in graph order."""
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def floating_value(n: torch.fx.Node) -> bool:
    """Whether Dynamo's example value of ``n`` is a floating tensor (the nodes worth comparing)."""
    v = n.meta.get("example_value", n.meta.get("val"))
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def prefix_graph(gm: torch.fx.GraphModule, upto: int) -> tuple[torch.fx.GraphModule, list[str]]:
    """A copy of ``gm`` cut after its ``upto``-th compute node, returning every floating node value so far.

    Returns the graph and the names of the nodes it outputs (in order)."""
    out = copy.deepcopy(gm)
    nodes = compute_nodes(out)
    last = nodes[upto]
    kept = [n for n in nodes[: upto + 1] if floating_value(n)]
    graph = out.graph
    output = next(n for n in graph.nodes if n.op == "output")
    graph.erase_node(output)
    with graph.inserting_after(last):
        graph.output(tuple(kept))
    # The nodes after the cut would run after the output: drop them, users first.
    nodes_all = list(graph.nodes)
    cut = nodes_all.index(next(n for n in nodes_all if n.op == "output"))
    for n in reversed(nodes_all[cut + 1 :]):
        graph.erase_node(n)
    graph.lint()
    out.recompile()
    return out, [n.name for n in kept]


class _Emulate(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Rounds the floating inputs of matmul-like ops as a reduced-precision matmul unit would (bf16 passes, TF32)."""

    def __init__(self, cast: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.cast = cast

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from tpudiag.analysis.op_kinds import op_kind

        name = getattr(getattr(func, "overloadpacket", None), "__name__", "")
        if op_kind(name) == "matmul" or name.startswith("convolution"):
            args = tuple(self.cast(a) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        return func(*args, **(kwargs or {}))


def emulated_replay(
    gm64: torch.fx.GraphModule, inputs64: Sequence[Any], cast: Callable[[torch.Tensor], torch.Tensor]
) -> list[Any]:
    """The float64 graph with its matmul inputs rounded by ``cast`` (what a device running fp32 matmuls at reduced
    precision computes, up to its own accumulation): a compiled error that matches it is expected precision."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad(), preserved_rng(), _Emulate(cast):
        return flat_outputs(gm64(*inputs64))
