"""The memory collector's records (the Memory page): its trace windows and one window's live bytes (the page takes
the rest from ``tpudiag.memory_report``, which reads the store through ``memory_queries``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpudiag.store import memory_queries
from tpudiag.store.database import Store


@dataclass
class MemoryView:
    windows: list[int]
    window: int | None
    timeline: list[dict[str, Any]]  # live bytes of ``window``
    timings: dict[str, float] = field(default_factory=dict)


def load_memory(store: Store, run_id: str, window: int | None = None) -> MemoryView:
    windows = memory_queries.windows(store, run_id)
    if window not in windows:
        window = memory_queries.peak_window(store, run_id) if windows else None
        if window not in windows:
            window = windows[0] if windows else None
    timeline = memory_queries.timeline(store, run_id, window) if window is not None else []
    return MemoryView(windows, window, timeline)
