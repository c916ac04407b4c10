"""Run metadata: host, versions, device, precision knobs, environment knobs, git commit.

Nothing here imports torch or torch_tpu: it reads them from ``sys.modules`` when the script loaded them, so it
never initialises a device runtime (a TPU runtime probe can hang or abort on a machine without a TPU).
"""

from __future__ import annotations

import contextlib
import os
import platform
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

ENV_PREFIXES = (
    "TORCH_",
    "TORCHINDUCTOR_",
    "TORCHDYNAMO_",
    "TPU_",
    "XLA_",
    "PJRT_",
    "LIBTPU_",
    "CUDA_",
    "NVIDIA_TF32",
)
ENV_EXACT = ("TORCH_TRACE", "TORCH_LOGS", "KINETO_LOG_LEVEL", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def host() -> str:
    return socket.gethostname()


def python_version() -> str:
    return platform.python_version()


def env_knobs(environ: dict[str, str] | None = None) -> dict[str, str]:
    environ = dict(os.environ if environ is None else environ)
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_EXACT}


def git_commit(path: Path) -> str | None:
    folder = path if path.is_dir() else path.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) >= 7 else None


def torch_version() -> str | None:
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "")) or None if torch is not None else None


def device() -> tuple[str, str | None]:
    """(kind, name) of the accelerator the script used: "tpu", "cuda" or "cpu"."""
    torch = sys.modules.get("torch")
    if torch is None:
        return "cpu", platform.processor() or platform.machine()
    if "torch_tpu" in sys.modules:
        with contextlib.suppress(Exception):
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
            if acc is not None and acc.type == "tpu":
                return "tpu", _tpu_name(torch)
    with contextlib.suppress(Exception):
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return "cuda", str(torch.cuda.get_device_name(torch.cuda.current_device()))
    return "cpu", platform.processor() or platform.machine()


def _tpu_name(torch: Any) -> str | None:
    with contextlib.suppress(Exception):
        props = torch.tpu.get_device_properties(0)
        return str(getattr(props, "name", props))
    return None


def precision() -> dict[str, Any]:
    """The precision knobs that decide how fp32 matmuls and convolutions run."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    out: dict[str, Any] = {}
    with contextlib.suppress(Exception):
        out["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    with contextlib.suppress(Exception):
        out["cuda_matmul_allow_tf32"] = bool(torch.backends.cuda.matmul.allow_tf32)
        out["cudnn_allow_tf32"] = bool(torch.backends.cudnn.allow_tf32)
        out["cuda_matmul_allow_fp16_reduced_precision"] = bool(
            torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        )
        out["cuda_matmul_allow_bf16_reduced_precision"] = bool(
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        )
    with contextlib.suppress(Exception):
        out["deterministic_algorithms"] = bool(torch.are_deterministic_algorithms_enabled())
    if "torch_tpu" in sys.modules:
        out.update(_tpu_precision(torch))
    return out


def _tpu_precision(torch: Any) -> dict[str, Any]:
    """TorchTPU's eager mode and global matmul precision (torch_tpu 0.2.0 names; both are experimental APIs).

    On TPU, fp32 matmul/conv run as one bf16 pass at ``Precision.DEFAULT`` (what "medium" maps to).
    """
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with contextlib.suppress(Exception):
            out["tpu_eager_mode"] = str(torch.tpu.eager_mode)
        with contextlib.suppress(Exception):
            from torch_tpu._internal.precision import precision_impl

            out["tpu_precision"] = str(precision_impl._get_global_precision())
        with contextlib.suppress(Exception):
            out["tpu_allow_excess_precision"] = bool(torch.tpu.allow_excess_precision)
    return out
