"""The memory collector's records (the Memory page): the report's memory section and one window's live bytes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tpudiag.store import memory_queries
from tpudiag.store.database import Store


@dataclass
class MemoryView:
    section: dict[str, Any] | None  # memory_report.build_section; None: no memory recorded
    windows: list[int]
    window: int | None
    timeline: list[dict[str, Any]]  # live bytes of ``window``
    timings: dict[str, float] = field(default_factory=dict)


def load_memory(store: Store, run_id: str, window: int | None = None) -> MemoryView:
    from tpudiag import memory_report

    section = memory_report.build_section(store, {"id": run_id})
    windows = memory_queries.windows(store, run_id) if section is not None else []
    if window not in windows:
        window = memory_queries.peak_window(store, run_id) if windows else None
        if window not in windows:
            window = windows[0] if windows else None
    timeline = memory_queries.timeline(store, run_id, window) if window is not None else []
    return MemoryView(section, windows, window, timeline)
