"""Whether a ``torch.amp.GradScaler`` is scaling this process's gradients (mixed-precision loss scaling).

A GradScaler multiplies the loss by its scale (65,536 to start) before the backward, so that small float16
gradients do not underflow.  While the scale is too large, the backward's float16 gradients overflow to inf; the
scaler's own check (``_amp_foreach_non_finite_check_and_unscale_``) finds them, skips that optimizer step and
lowers the scale.  Those overflows are the scaler at work, as every fp16 run of the HF Trainer or Accelerate does
in its first steps, not an op computing a wrong result: the judge gives them the ``scaled_overflow`` verdict
(not divergent) instead of ``overflow``.

Scalers are found without touching the script's code or tensors: the garbage collector's objects are searched
for GradScaler instances the first time a backward overflow is judged (and again at most every ``RESCAN_S``
while none is found), and an instance counts once it is enabled and has scaled a loss (its scale tensor exists;
its value is never read: on an accelerator that would be a device sync).
"""

from __future__ import annotations

import gc
import time
import weakref
from typing import Any

RESCAN_S = 30.0


class ScalerWatch:
    def __init__(self, clock: Any = time.monotonic) -> None:
        self._scalers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._scanned_at: float | None = None
        self._clock = clock

    def scaling(self) -> bool:
        """Whether an enabled GradScaler that has scaled a loss is alive."""
        if any(_scaling(s) for s in list(self._scalers)):
            return True
        now = self._clock()
        if self._scanned_at is not None and now - self._scanned_at < RESCAN_S:
            return False
        self._scanned_at = now
        cls = _scaler_class()
        if cls is None:
            return False
        for obj in gc.get_objects():
            # type(), not isinstance(): isinstance reads ``__class__``, which some objects answer with a warning
            # (torch.distributed.reduce_op) that would land in the script's output.
            if issubclass(type(obj), cls):
                self._scalers.add(obj)
        return any(_scaling(s) for s in list(self._scalers))


def _scaler_class() -> type[Any] | None:
    try:
        from torch.amp import GradScaler  # torch.cuda.amp's and FSDP's sharded scaler are subclasses
    except ImportError:
        return None
    return GradScaler  # type: ignore[no-any-return]


def _scaling(scaler: Any) -> bool:
    return bool(getattr(scaler, "_enabled", False)) and getattr(scaler, "_scale", None) is not None
