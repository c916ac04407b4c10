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
    """Bytes a check of a call with these input tensors and this result holds at once (float64 elements)."""
    from tpudiag.oracle import ops as oracle

    held = sum(t.numel() for t in inputs)
    for t in oracle.tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor):
            held += 3 * t.numel()
    return 8 * held
