"""How the report and the dashboard show a run's paths, precision knobs and op kinds to a reader.

- Source locations: a library file relative to the folder its package is installed in
  (``transformers/models/llama/modeling_llama.py:66``, not ``/home/u/.venv/lib/python3.11/site-packages/...``),
  a user file relative to the script's folder (``model.py:12``); other paths are kept whole.
- Precision knobs: only those that apply to the run's device (no CUDA TF32 switch on a CPU or TPU run).
- Op kinds in a host op ranking: the ops that compute (``aten::``, XLA HLO ops) apart from autograd's bookkeeping.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

_INSTALL_DIRS = re.compile(r"[/\\](?:site-packages|dist-packages)[/\\]")
_STDLIB = re.compile(r"[/\\]lib[/\\]python\d+(?:\.\d+)?[/\\]")
_LINE = re.compile(r"^(.*?)(:\d+(?::\d+)?)?$")


def short_source(source: str | None, script: str | None = None) -> str | None:
    """``path[:line]`` shortened as the module docstring says."""
    if not source:
        return source
    m = _LINE.match(source)
    path, line = (m.group(1), m.group(2) or "") if m else (source, "")
    found = list(_INSTALL_DIRS.finditer(path))
    if found:
        return path[found[-1].end() :] + line
    if script:
        base = os.path.dirname(os.path.abspath(script))
        try:
            rel = os.path.relpath(path, base)
        except ValueError:  # another drive (Windows)
            rel = path
        if os.path.isabs(path) and not rel.startswith(".."):
            return rel + line
    stdlib = list(_STDLIB.finditer(path))
    if stdlib:
        return path[stdlib[-1].end() :] + line
    return source


# Knob name prefixes that only matter on one kind of device.
_DEVICE_KNOBS = {"cuda": ("cuda_", "cudnn_"), "tpu": ("tpu_", "torch_tpu")}


def device_precision(precision: Mapping[str, Any], device_kind: str | None) -> dict[str, Any]:
    """The knobs of ``precision`` that apply on ``device_kind`` ("cpu" | "cuda" | "tpu"; None keeps all)."""
    if device_kind is None:
        return dict(precision)
    foreign = tuple(p for kind, prefixes in _DEVICE_KNOBS.items() if kind != device_kind for p in prefixes)
    return {k: v for k, v in precision.items() if not k.startswith(foreign)}


AUTOGRAD_PREFIXES = ("autograd::", "torch::autograd::")


def host_op_kind(name: str, category: str | None = None) -> str:
    """``compute`` (aten and XLA HLO ops), ``autograd`` (the engine's bookkeeping around backward ops) or
    ``other`` (optimizer steps, runtime calls, ...)."""
    if name.startswith(AUTOGRAD_PREFIXES):
        return "autograd"
    if name.startswith("aten::") or category in ("xla_host_op", "xla_op"):
        return "compute"
    return "other"
