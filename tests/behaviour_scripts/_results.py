"""What each behaviour script prints about its results: exact values and a bitwise digest, and Dynamo's counters.

Imported by the scripts beside it (their folder is sys.path[0], as for any script).
"""

import hashlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

_digest = hashlib.sha256()


def add(label, value):
    """Fold tensors (bit patterns), numbers and strings into the run's digest; print a short line for each."""
    leaves = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            leaves.append(x)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif hasattr(x, "to_tuple"):
            walk(x.to_tuple())
        elif x is not None:
            _digest.update(repr(x).encode())

    walk(value)
    for t in leaves:
        t = t.detach()
        if t.is_sparse:
            t = t.to_dense()
        t = t.cpu().contiguous().reshape(-1)
        if t.is_complex():
            t = torch.view_as_real(t).contiguous()
        _digest.update(str((t.dtype, tuple(t.shape))).encode())
        _digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    print(label, len(leaves), "tensors")


def params(model):
    return [p for p in model.parameters()]


def dynamo_counters():
    """The counters a compile is judged by: frames, graphs, recompiles, graph breaks, unique graphs."""
    from torch._dynamo.utils import counters

    keep = ("frames", "stats", "graph_break", "recompiles", "unimplemented")
    return {k: dict(sorted(v.items())) for k, v in sorted(counters.items()) if k in keep and v}


def finish():
    print("digest", _digest.hexdigest())
