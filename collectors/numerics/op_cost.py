"""What one op call costs and where it came from: its FLOPs (torch's formulas, cached per signature) and the
user's source line."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

_TORCH_DIR = os.path.dirname(torch.__file__)
_OWN_DIRS = tuple(os.path.dirname(os.path.abspath(p)) for p in (__file__, sys.modules["tpudiag"].__file__ or ""))
_SKIP_PREFIXES = (_TORCH_DIR, *_OWN_DIRS, os.path.dirname(os.__file__) + os.sep + "contextlib")


def user_source(depth: int = 2) -> str | None:
    """``file:line`` of the innermost Python frame outside torch and tpudiag (library code such as transformers
    counts as the user's: it is where the op was called)."""
    try:
        frame: Any = sys._getframe(depth)
    except ValueError:
        return None
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_SKIP_PREFIXES) and not path.startswith("<frozen"):
            return f"{_shown(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


_SHOWN: dict[tuple[str, str], str] = {}
_MAX_SHOWN = 1 << 12


def _shown(path: str) -> str:
    """``path`` relative to the working directory when it lies below it, cached (``os.path.relpath`` took half of
    a watched step's per-call rows of views)."""
    try:
        key = (os.getcwd(), path)
    except OSError:  # the working directory was removed
        return path
    shown = _SHOWN.get(key)
    if shown is None:
        try:
            rel = os.path.relpath(path)
            shown = rel if not rel.startswith("..") else path
        except ValueError:
            shown = path
        if len(_SHOWN) < _MAX_SHOWN:
            _SHOWN[key] = shown
    return shown


_FLOPS: dict[tuple[Any, ...], float] = {}
_MAX_FLOP_KEYS = 1 << 16


def _flops(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: Any,
    outputs: list[Any],
    signature: tuple[Any, ...] | None = None,
) -> float:
    """FLOPs of one call: torch's flop formulas (matmul, conv, attention), else one per output element.

    Formulas read only shapes (and, for convolutions, the scalar arguments): cached per signature and output shapes.
    """
    from torch.utils.flop_counter import flop_registry

    fn = flop_registry.get(getattr(func, "overloadpacket", None))
    if fn is not None:
        key: tuple[Any, ...] | None = None
        if signature is not None:
            # int[] arguments arrive as lists or tuples (conv stride/padding): keyed as nested tuples.
            scalars = tuple(
                _frozen(a) for a in args if isinstance(a, (int, float, bool, list, tuple)) and not _has_tensor(a)
            )
            outs = tuple(tuple(t.shape) for t in outputs if isinstance(t, torch.Tensor))
            key = (signature, scalars, outs)
            hit = _FLOPS.get(key)
            if hit is not None:
                return hit
        try:
            value = float(fn(*args, **kwargs, out_val=out))
        except Exception:
            value = float(sum(t.numel() for t in outputs if isinstance(t, torch.Tensor)))
        if key is not None and len(_FLOPS) < _MAX_FLOP_KEYS:
            _FLOPS[key] = value
        return value
    return float(sum(t.numel() for t in outputs if isinstance(t, torch.Tensor)))


def _frozen(x: Any) -> Any:
    return tuple(_frozen(y) for y in x) if isinstance(x, (list, tuple)) else x


def _has_tensor(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and any(isinstance(y, torch.Tensor) or _has_tensor(y) for y in x)


def _device(tensors: list[torch.Tensor]) -> str | None:
    for t in tensors:
        if t.device.type != "cpu":
            return str(t.device)
    return "cpu" if tensors else None
