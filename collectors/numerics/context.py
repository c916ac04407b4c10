"""The per-run settings the numerics dispatch mode needs besides sampling."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tpudiag.model import OpDiff, OpRecord

DEFAULT_SIZE_CAP = 1 << 24  # elements per op (inputs and outputs): larger calls are skipped as "size_cap"


@dataclass
class Context:
    """Per-run settings the mode needs besides sampling."""

    run_id: str
    device_kind: str = "cpu"
    emulations: tuple[str, ...] = ()  # reduced-precision matmul units to emulate: "bf16", "tf32"
    precision_json: str | None = None
    size_cap: int = DEFAULT_SIZE_CAP
    module_of: Callable[[str], str | None] | None = None  # phase -> current module path
    on_divergence: Callable[[OpRecord, OpDiff], None] | None = None
