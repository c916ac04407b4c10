"""Memory inside one trace window: called by the trace collector for each Chrome trace chunk it analyses.

With ``profile_memory`` on, the chunk's ``[memory]`` events (``tpudiag.traces.kineto_memory``) become the window's
live-bytes timeline, the blocks live at its peak by module and op, its largest allocations and each step's peak
(``tpudiag.analysis.memory_events``).  When the script died of an out-of-memory error (``memory/oom.json``, left by
the memory collector, which stops before the trace), the last window also names the op that asked (the last op to
end: see ``memory_events.failing_op``) and what was live when it started, and the OOM record is written again
with them (same spool part: it replaces the first).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tpudiag.plugins import CaptureContext


def _window_index(path: Path) -> int:
    m = re.search(r"(\d+)", path.stem)
    return int(m.group(1)) if m else 0


def spool_window(ctx: CaptureContext, path: Path, trace: Any, tables: Any, part: str | None = None) -> None:
    """Spool what the window at ``path`` says about memory (nothing without memory events or an OOM)."""
    from tpudiag.collectors.memory import oom_path, write_oom

    oom_file = oom_path(ctx.run_dir)
    oom = json.loads(oom_file.read_text()) if oom_file.exists() else None
    if oom is not None and oom.get("op_source"):
        oom = None  # already completed by an earlier window
    profiled = bool(ctx.options.get("profile_memory"))
    if not profiled and oom is None:
        return
    from tpudiag.analysis import memory_events

    site = memory_events.failing_op(tables.events) if oom is not None else None
    if profiled:
        from tpudiag.model import MemoryBlock, MemoryPoint, MemoryStep, records_to_arrow
        from tpudiag.traces import kineto_memory

        mem = kineto_memory.load(path)
        if len(mem):
            sites = memory_events.attribute(mem, tables.events, trace.thread_names)
            window = memory_events.analyse(
                mem, sites, ctx.run_id, _window_index(path), tables.steps,
                oom_start_ns=site["start_ns"] if site else None,
            )  # fmt: skip
            for cls, rows in ((MemoryPoint, window.points), (MemoryBlock, window.blocks), (MemoryStep, window.steps)):
                if rows:
                    ctx.spool.write_table(cls.TABLE, records_to_arrow(cls, rows), part=part)
            ctx.metadata.setdefault("memory", {})["method"] = memory_events.METHOD
    if oom is not None and site is not None:
        oom["op"] = site["op"]
        oom["op_source"] = "profiler"
        if oom.get("module") is None:
            oom["module"] = site["module"]
        if oom.get("step") is None:
            oom["step"] = site["step"]
        from tpudiag.analysis.oom_text import parse

        parsed = parse(oom["message"], oom.get("exception"))
        write_oom(ctx, oom, parsed.allocations if parsed else [])
