"""Live tensor bytes counted at dispatch, by module and op: the memory view where the profiler records no device
allocator events (TorchTPU's Kineto path does not merge device memory events yet).  Opt-in (``--memory-dispatch``):
a dispatch mode is active while the script runs, and while one is, torch.compile runs eagerly (DESIGN §4.2).

Every op's output storages are counted once, when first seen, with the module path, op and input shapes of the op
that produced them; a storage is counted free when Python's last reference to it goes (``weakref.finalize`` on the
storage: PyTorch keeps one Python object per storage, so the finaliser runs when the storage itself dies).  What
this sees is what the allocator holds for tensors, not the allocator's cache or a compiled program's temporaries.

The events of each window (one flush interval or 200,000 events) go through the same analysis as the profiler's
(``tpudiag.analysis.memory_events``) with method "dispatch".  On an exception inside an op, the op, its input shapes
and the live bytes by module are kept for the out-of-memory record.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import weakref
from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

METHOD = "dispatch"
Site = tuple[str | None, str | None, str | None, int | None]  # module, op, input shapes, step
MAX_EVENTS = 200_000  # a window is cut early beyond this (bounded memory on long runs)


def _shapes(args: Any, kwargs: Any) -> str | None:
    flat, _ = tree_flatten((args, kwargs))
    dims = [list(a.shape) for a in flat if isinstance(a, torch.Tensor)]
    return json.dumps(dims, separators=(",", ":")) if dims else None


def _op_name(func: Any) -> str:
    """``aten::repeat`` for an OpOverload (the name the profiler's events carry)."""
    schema = getattr(func, "_schema", None)
    return str(schema.name) if schema is not None else str(func)


class LiveBytes(TorchDispatchMode):
    """The dispatch mode; ``module_of()`` names the running module, ``step_of()`` the step."""

    def __init__(self, module_of: Any, step_of: Any) -> None:
        super().__init__()
        self._module_of, self._step_of = module_of, step_of
        # Re-entrant: a storage's finaliser can run (garbage collection) while this thread holds the lock.
        self._lock = threading.RLock()
        self._live: dict[tuple[str, int], tuple[int, Site]] = {}  # (device, ptr) -> (bytes, site)
        self.events: list[tuple[int, str, int, int, Site]] = []  # ts_ns, device, ptr, ±bytes, site
        self._totals: dict[str, int] = defaultdict(int)
        self.totals_after: list[int] = []
        self.failed_op: dict[str, Any] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception:
            if self.failed_op is None:
                self.failed_op = {
                    "op": _op_name(func),
                    "shapes": _shapes(args, kwargs),
                    "module": self._module_of(),
                    "holders": self.live_by_module(),
                }
            raise
        with contextlib.suppress(Exception):  # bookkeeping never breaks the op
            self._count(func, out, args, kwargs)
        return out

    def _count(self, func: Any, out: Any, args: Any, kwargs: Any) -> None:
        flat, _ = tree_flatten(out)
        site: Site | None = None
        for t in flat:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            nbytes = int(storage.nbytes())
            key = (str(t.device), int(storage.data_ptr()))
            if nbytes == 0 or key in self._live:
                continue
            if site is None:
                site = (self._module_of(), _op_name(func), _shapes(args, kwargs), self._step_of())
            with self._lock:
                self._live[key] = (nbytes, site)
                self._record(key, nbytes, site)
            weakref.finalize(storage, self._free, key)

    def _record(self, key: tuple[str, int], nbytes: int, site: Site) -> None:
        self._totals[key[0]] += nbytes
        self.events.append((time.time_ns(), key[0], key[1], nbytes, site))
        self.totals_after.append(self._totals[key[0]])

    def _free(self, key: tuple[str, int]) -> None:
        with self._lock:
            held = self._live.pop(key, None)
            if held is not None:
                self._record(key, -held[0], held[1])

    def live_by_module(self) -> list[dict[str, Any]]:
        sums: dict[str, int] = defaultdict(int)
        with self._lock:
            for nbytes, site in self._live.values():
                sums[site[0] or "(outside modules)"] += nbytes
        return [{"module": m, "bytes": b} for m, b in sorted(sums.items(), key=lambda kv: -kv[1])]

    def take_window(self) -> tuple[Any, Any] | None:
        """The events since the last call as (MemoryEvents, Sites) for ``memory_events.analyse``; None if none."""
        from tpudiag.analysis.memory_events import MemoryEvents, Sites

        with self._lock:
            events, self.events = self.events, []
            totals, self.totals_after = self.totals_after, []
        if not events:
            return None
        devices: dict[str, int] = {}
        device = np.array([devices.setdefault(e[1], len(devices)) for e in events], dtype=np.int32)
        mem = MemoryEvents(
            ts_ns=np.array([e[0] for e in events], dtype=np.int64),
            addr=np.array([e[2] for e in events], dtype=np.int64),
            nbytes=np.array([e[3] for e in events], dtype=np.int64),
            total_allocated=np.array(totals, dtype=np.int64),
            total_reserved=np.full(len(events), -1, dtype=np.int64),
            device=device,
            devices=list(devices),
            threads=[("", "")] * len(events),
        )
        site_rows = [e[4] for e in events]
        sites = Sites(
            module=[s[0] for s in site_rows],
            op=[s[1] for s in site_rows],
            shapes=[s[2] for s in site_rows],
            step=[s[3] for s in site_rows],
        )
        return mem, sites

    def full(self) -> bool:
        return len(self.events) >= MAX_EVENTS
