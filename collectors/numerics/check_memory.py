"""How much memory one float64 check may hold once a long run has settled (issue 21: peak RSS bounded).

A check holds float64 copies of its op's inputs and, per output, the oracle's value, the output's own float64 copy
and their difference: a 2M-element ``torch.sort`` checked in a trace window added ~135 MB of transient RSS over the
sort's own 72 MB, and the size cap alone (16M elements) lets a check take a gigabyte.  The run's first steps check
every op up to the size cap as before (a short script loses nothing); past them (``Sampler.begin_step`` with
``capped``: the run has settled and its first trace window is over), a call whose check would hold more than the
allowance is skipped as ``size_cap``: trace windows and periodic re-checks look at every smaller op as before.

The allowance is an eighth of the process's peak RSS when the run settled, and at least ``MIN_BYTES``: a job that
holds gigabytes on the host keeps checking its large ops, a small one's checks stay within a few tens of MB.
``--numerics all`` asks for every call and gets it (no allowance, as no check time).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

MIN_BYTES = 64 << 20
SHARE = 8  # the allowance: the process's peak RSS when the run settled, divided by this


def allowance() -> int:
    """Bytes one check may hold: ``max(MIN_BYTES, peak RSS / SHARE)``."""
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    except Exception:
        return MIN_BYTES
    return max(MIN_BYTES, int(peak) // SHARE)


def estimate(inputs: list[torch.Tensor], out: Any) -> int:
    """Bytes a check of a call with these input tensors and this result holds at once (float64 elements; a
    complex element counts twice)."""
    from tpudiag.oracle import ops as oracle

    held = sum(t.numel() * (2 if t.is_complex() else 1) for t in inputs)
    for t in oracle.tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            held += 3 * t.numel() * (2 if t.is_complex() else 1)
    return 8 * held


def graph_elements(gm: Any) -> tuple[int, int] | None:
    """A compiled graph's values by Dynamo's example values, in elements: (the most alive at once when its nodes run
    in order, each freed after its last use: a replay without autograd; all of them: a replay that keeps its
    autograd graph for a reference backward).  None when a size is not known (symbolic shapes)."""
    nodes = list(gm.graph.nodes)
    last_use: dict[Any, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last_use[a] = i
    sizes: dict[Any, int] = {}
    live = peak = total = 0
    for i, n in enumerate(nodes):
        if n.op in ("call_function", "call_method", "call_module"):
            size = _elements(n.meta.get("example_value", n.meta.get("val")))
            if size is None:
                return None
            sizes[n] = size
            live += size
            total += size
            peak = max(peak, live)
        for a in n.all_input_nodes:
            if last_use.get(a) == i and a in sizes:
                live -= sizes.pop(a)
    return peak, total


def graph_estimate(inputs: int, replay: tuple[int, int], grad: bool) -> int:
    """Bytes a graph check holds at once: its inputs three times (the snapshot, their float64 copies, the eager
    replay's clones) and two replays' values (float64 and the device dtype, both counted at 8 bytes)."""
    return 8 * (3 * inputs + 2 * (replay[1] if grad else replay[0]))


def _elements(value: Any) -> int | None:
    from tpudiag.oracle import ops as oracle

    total = 0
    for t in oracle.tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor):
            n = t.numel()
            if not isinstance(n, int):  # a symbolic size (``int()`` gives the first compile's hint, not this call's)
                return None
            total += n * (2 if t.is_complex() else 1)
    return total
