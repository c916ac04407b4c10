"""What the numerics collector reads of the machine at start: the accelerator the script can use, the
reduced-precision matmul units that could have run its fp32 matmuls, and what a dispatch mode costs per op here
(charged to ``--budget``)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any


def emulations_for(device_kind: str, precision: dict[str, Any]) -> tuple[str, ...]:
    """Reduced-precision matmul units that could have run the run's fp32 matmuls (emulated on a finding)."""
    matmul_precision = str(precision.get("float32_matmul_precision", "highest"))
    if device_kind == "tpu":
        tpu = str(precision.get("tpu_precision", "")).upper()
        return () if "HIGHEST" in tpu else ("bf16",)
    if device_kind == "cuda":
        out: list[str] = []
        if precision.get("cuda_matmul_allow_tf32") or precision.get("cudnn_allow_tf32") or (matmul_precision == "high"):
            out.append("tf32")
        if matmul_precision == "medium":
            out.append("bf16")
        return tuple(out)
    return ("bf16",) if matmul_precision == "medium" else ()


def device_kind() -> str:
    """The accelerator the script can use, read without initialising a runtime that is not there."""
    import torch

    if "torch_tpu" in sys.modules:
        with contextlib.suppress(Exception):
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            if acc is not None and acc.type == "tpu":
                return "tpu"
    with contextlib.suppress(Exception):
        if torch.cuda.is_available():
            return "cuda"
    return "cpu"


def calibrate_overhead(calls: int = 300) -> float:
    """Seconds a pass-through dispatch mode adds to one small op (charged to the budget per op seen)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Pass(TorchDispatchMode):  # type: ignore[no-untyped-call]
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {}))

    x = torch.ones(4)
    costs = []
    for _ in range(4):  # the first round pays one-time setup: keep the cheapest
        t0 = time.perf_counter()
        for _ in range(calls):
            torch.add(x, x)
        plain = time.perf_counter() - t0
        with _Pass():  # type: ignore[no-untyped-call]
            t0 = time.perf_counter()
            for _ in range(calls):
                torch.add(x, x)
            moded = time.perf_counter() - t0
        costs.append((moded - plain) / calls)
    # The mode measures its own Python time per call; this is the part it cannot see (entering Python).
    return max(0.0, min(costs))
