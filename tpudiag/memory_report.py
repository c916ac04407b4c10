"""The report's ``memory`` section: per-step memory, the peak and what was live at it by module, the largest
allocations, and the out-of-memory diagnosis.

``source`` says where ``peak_bytes`` came from (an allocator counter, the profiler's memory events, or the process's
RSS when nothing else answered); ``method`` says how blocks were attributed to modules and ops ("profiler": the
profiler's allocator events; None: no trace window recorded them).
"""

from __future__ import annotations

from typing import Any

from tpudiag.store import Store, memory_queries

MAX_STEPS_LISTED = 500
TOP = 20
RSS_SOURCE = "process RSS at step ends (/proc/self/statm)"


def _peak(per_step: list[dict[str, Any]], points: list[dict[str, Any]]) -> tuple[int | None, int | None, str | None]:
    """(peak bytes, its step, its source)."""
    best: tuple[int | None, int | None, str | None] = (None, None, None)
    for s in per_step:
        if s["peak_bytes"] is not None and (best[0] is None or s["peak_bytes"] > best[0]):
            best = (s["peak_bytes"], s["step"], s["sources"].get("peak_bytes"))
    if best[0] is None and points:
        top = max(points, key=lambda p: p["allocated_bytes"])
        best = (top["allocated_bytes"], top["step"], "profiler memory events (Total Allocated)")
    if best[0] is None:
        for s in per_step:
            if s["rss_bytes"] is not None and (best[0] is None or s["rss_bytes"] > best[0]):
                best = (s["rss_bytes"], s["step"], RSS_SOURCE)
    return best


def build_section(store: Store, run: dict[str, Any]) -> dict[str, Any] | None:
    run_id = run["id"]
    if not memory_queries.has_memory(store, run_id):
        return None
    per_step = memory_queries.per_step(store, run_id)
    points = memory_queries.timeline(store, run_id)
    peak, peak_step, source = _peak(per_step, points)
    window = memory_queries.peak_window(store, run_id)
    at_peak = memory_queries.blocks(store, run_id, "at_peak", window) if window is not None else []
    top = memory_queries.blocks(store, run_id, "top_alloc")[:TOP]
    method = (at_peak or top or [{"method": None}])[0]["method"]
    oom = memory_queries.oom(store, run_id)
    if oom is not None:
        if oom.get("last_good_peak_bytes") is None and oom.get("step"):
            prev = next((s for s in per_step if s["step"] == oom["step"] - 1), None)
            if prev is not None:
                oom["last_good_peak_bytes"] = (
                    prev["peak_bytes"] if prev["peak_bytes"] is not None else prev["rss_bytes"]
                )
        held = memory_queries.blocks(store, run_id, "at_oom")
        oom["holders"] = memory_queries.by_module(held)[:TOP]
    return {
        "source": source,
        "method": method,
        "device": next((s["device"] for s in per_step if s.get("device")), None),
        "peak_bytes": peak,
        "peak_step": peak_step,
        "limit_bytes": next((s["limit_bytes"] for s in reversed(per_step) if s["limit_bytes"] is not None), None),
        "per_step": per_step[:MAX_STEPS_LISTED],
        "by_module_at_peak": memory_queries.by_module(at_peak),
        "at_peak": [_block(b) for b in at_peak[:TOP]],
        "top_allocations": [_block(b) for b in top],
        "oom": oom,
    }


def _block(b: dict[str, Any]) -> dict[str, Any]:
    return {k: b[k] for k in ("bytes", "count", "module", "op", "shapes", "step", "device")}


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    """Right-aligned columns (every column of this section is a number)."""
    widths = [max(len(c) for c in col) for col in zip(headers, *rows, strict=True)]
    return [
        "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
        for r in [headers, ["-" * w for w in widths], *rows]
    ]


def render_section(section: dict[str, Any]) -> list[str]:
    hb = human_bytes
    lines = [
        f"memory: peak {hb(section['peak_bytes'])}"
        + (f" at step {section['peak_step']}" if section["peak_step"] is not None else "")
        + f" ({section['source'] or 'no source answered'})"
        + (f"; limit {hb(section['limit_bytes'])}" if section.get("limit_bytes") else "")
    ]
    steps = section["per_step"]
    if steps:
        shown = steps if len(steps) <= 8 else [*steps[:4], *steps[-4:]]
        lines.append("  per step:")
        rows = [
            [str(s["step"]), hb(s["allocated_bytes"]), hb(s["reserved_bytes"]), hb(s["peak_bytes"]), hb(s["rss_bytes"])]
            for s in shown
        ]
        lines += ["    " + line for line in _table(["step", "allocated", "reserved", "peak", "rss"], rows)]
    if section["by_module_at_peak"]:
        lines.append(f"  live at the peak, by module ({section['method']} method):")
        lines += [f"    {hb(m['bytes']):>12}  {m['module']}" for m in section["by_module_at_peak"][:8]]
    if section["top_allocations"]:
        lines.append("  largest allocations:")
        lines += [
            f"    {hb(a['bytes']):>12}  {a['op'] or '?'} {a['shapes'] or ''} in {a['module'] or '-'} (step {a['step']})"
            for a in section["top_allocations"][:5]
        ]
    oom = section.get("oom")
    if oom:
        lines.append(
            f"  OUT OF MEMORY ({oom['kind']}{', ' + oom['phase'] if oom.get('phase') else ''}) at step {oom['step']}"
            f" in {oom['module'] or '?'}, op {oom['op'] or '?'}: asked for {hb(oom['requested_bytes'])}, live "
            f"{hb(oom['live_bytes'])}, limit {hb(oom['limit_bytes'])}; last good step's peak "
            f"{hb(oom.get('last_good_peak_bytes'))}"
        )
        for h in oom.get("holders", [])[:5]:
            lines.append(f"    held {hb(h['bytes']):>12}  {h['module']}")
        for a in oom.get("allocations", [])[:5]:
            lines.append(
                f"    XLA #{a['position']}: {hb(a['size_bytes'])} {a['shape'] or ''} {a['operator'] or ''}".rstrip()
            )
    return lines
