"""Float64 copies of the script's tensors, made once and reused by every checked op that reads the same tensor.

The oracle needs each input in float64.  A tensor is usually read by several ops (an activation by the next op
and by backward, a gradient by several optimizer ops), and each op's *output* is upcast anyway to be compared:
keeping that float64 copy lets the next op that reads the tensor skip its own copy.  A copy is used only while the
tensor is the same object (weakly keyed: the cache never keeps a user's tensor alive) with the same version
counter, data pointer, shape and strides, *and* still holds exactly the copied values.

The version counter alone does not prove a tensor unchanged: many writes never bump it.  ``_fused_adam(w)_`` and
the other fused optimizer kernels write their tensor lists without a bump, ``_foreach_*_`` ops skip it while any
dispatch mode is active (as this checker's is), Inductor's generated kernels write into reused buffers below the
dispatcher, and so do C++ extensions and writes through ``.numpy()``.  A copy trusted on its version alone fed
the oracle an old value (an optimizer's step count one behind: 1e6 scaled eps on a correct ``_fused_adamw_``), so
a hit is confirmed by comparing the kept copy with the tensor itself (``torch.equal``: float64 holds every float32,
bfloat16 and float16 value exactly; a NaN makes them unequal, which only costs a fresh copy).  Writes the checker
sees (an op whose schema says it writes an argument) drop the written tensors' copies at once (``forget``).
Values are exactly ``tensor.to(float64, copy=True)``: reuse changes no result.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

# Copies above this many bytes in total are not kept (they are still made and used once).
DEFAULT_MAX_BYTES = 1 << 30
_RECOUNT_EVERY = 256


class Float64Copies:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._map: Any = WeakIdKeyDictionary()
        self._bytes = 0
        self._refused = 0
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self.stale = 0  # entries whose tensor had changed without a version bump (caught by the value check)

    def __len__(self) -> int:
        return len(self._map)

    def get(self, tensor: torch.Tensor) -> torch.Tensor | None:
        entry = self._map.get(tensor)
        if entry is None:
            self.misses += 1
            return None
        version, ptr, shape, stride, value = entry
        if version != tensor._version or ptr != tensor.data_ptr() or shape != tensor.shape or stride != tensor.stride():
            self._drop(tensor)
            self.misses += 1
            return None
        if not torch.equal(value, tensor):
            self._drop(tensor)
            self.stale += 1
            self.misses += 1
            return None
        self.hits += 1
        result: torch.Tensor = value
        return result

    def forget(self, tensors: list[torch.Tensor]) -> None:
        """Drop the copies of tensors an op is about to write."""
        if len(self._map):
            for t in tensors:
                self._drop(t)

    def put(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """Remember ``value`` (exactly ``tensor`` in float64, owned by the checker, never written) for ``tensor``."""
        if tensor.device.type == "meta":
            return
        self._drop(tensor)
        size = value.numel() * value.element_size()
        if self._bytes + size > self.max_bytes:
            self._refused += 1
            if self._refused % _RECOUNT_EVERY != 1:
                return
            # Entries of tensors that died left the map without a word: recount now and then.
            self._bytes = sum(e[4].numel() * e[4].element_size() for e in self._map.values())
            if self._bytes + size > self.max_bytes:
                return
        self._map[tensor] = (tensor._version, tensor.data_ptr(), tensor.shape, tensor.stride(), value)
        self._bytes += size

    def _drop(self, tensor: torch.Tensor) -> None:
        entry = self._map.pop(tensor, None)
        if entry is not None:
            self._bytes -= entry[4].numel() * entry[4].element_size()

    def clear(self) -> None:
        self._map = WeakIdKeyDictionary()
        self._bytes = 0
