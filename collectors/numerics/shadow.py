"""The shadow float64 stream: what each tensor *would* hold had every op before it been exact.

Only tensors whose shadow differs materially from their real value are tracked (the outputs of divergent ops and
of the ops they feed), so a clean run holds nothing and pays nothing.  Tensors are keyed by identity (weakly, so
the stream never keeps a user's tensor alive) together with their version counter: any mutation not seen by the
stream (an in-place op on a view of the tensor, an unchecked op) bumps the version and the stale shadow is
ignored, which can only hide propagation, never invent it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Shadows above this many bytes in total are dropped oldest-first (the stream is a diagnostic, not a copy of the
# model's memory).
DEFAULT_MAX_BYTES = 2 << 30


@dataclass
class _Entry:
    value: torch.Tensor
    version: int


class ShadowStream:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._map: Any = WeakIdKeyDictionary()
        self._bytes = 0
        self.max_bytes = max_bytes
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._map)

    def get(self, tensor: torch.Tensor) -> torch.Tensor | None:
        entry: _Entry | None = self._map.get(tensor)
        if entry is None:
            return None
        if entry.version != tensor._version or entry.value.shape != tensor.shape:
            self.forget(tensor)
            return None
        return entry.value

    def has_any(self, tensors: list[torch.Tensor]) -> bool:
        if not len(self._map):
            return False
        return any(self.get(t) is not None for t in tensors)

    def set(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        self.forget(tensor)
        size = value.numel() * value.element_size()
        if self._bytes + size > self.max_bytes:
            # Entries of tensors that died left the map without a word: recount before giving up.
            self._bytes = sum(e.value.numel() * e.value.element_size() for e in self._map.values())
        if self._bytes + size > self.max_bytes:
            self.dropped += 1
            return
        self._map[tensor] = _Entry(value, tensor._version)
        self._bytes += size

    def forget(self, tensor: torch.Tensor) -> None:
        entry: _Entry | None = self._map.pop(tensor, None)
        if entry is not None:
            self._bytes -= entry.value.numel() * entry.value.element_size()

    def clear(self) -> None:
        self._map = WeakIdKeyDictionary()
        self._bytes = 0
