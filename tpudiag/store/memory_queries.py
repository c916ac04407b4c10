"""Reads of the memory collector's tables: per-step figures, the peak and what was live at it, the largest
allocations, live bytes over a window, and the out-of-memory record with XLA's allocation table."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from tpudiag.store.database import Store

if TYPE_CHECKING:
    import duckdb

FIGURES = ("allocated_bytes", "reserved_bytes", "peak_bytes", "rss_bytes", "device_used_bytes", "limit_bytes")


def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    cols = [d[0] for d in cur.description or []]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def has_memory(store: Store, run_id: str) -> bool:
    with store.reader() as r:
        rows = r.execute(
            "SELECT (SELECT count(*) FROM (SELECT 1 FROM memory_steps WHERE run_id = ? LIMIT 1)) + "
            "(SELECT count(*) FROM (SELECT 1 FROM memory_oom WHERE run_id = ? LIMIT 1)) + "
            "(SELECT count(*) FROM (SELECT 1 FROM memory_blocks WHERE run_id = ? LIMIT 1))",
            [run_id, run_id, run_id],
        ).fetchall()
    return bool(rows[0][0])


def per_step(store: Store, run_id: str, rank: int = 0, limit: int | None = None) -> list[dict[str, Any]]:
    """One row per step: each figure from the sampler, except the peak, which the profiler's events give per step
    when a trace window recorded them (the sampler's allocator peak is the peak since the process started).
    ``sources`` says where each figure came from; a figure nobody gave is None."""
    with store.reader() as r:
        rows = _dicts(
            r.execute(
                "SELECT step, origin, ts_ns, device, " + ", ".join(FIGURES) + ", sources FROM memory_steps "
                "WHERE run_id = ? AND rank = ? ORDER BY step, origin",
                [run_id, rank],
            )
        )
    steps: dict[int, dict[str, Any]] = {}
    for row in rows:
        out = steps.setdefault(row["step"], {"step": row["step"], "device": row["device"], "sources": {}})
        sources = json.loads(row["sources"]) if row["sources"] else {}
        for fig in FIGURES:
            value = row[fig]
            if value is None:
                continue
            prefer = fig == "peak_bytes" and row["origin"] != "sampler"
            if out.get(fig) is None or prefer:
                out[fig] = value
                out["sources"][fig] = sources.get(fig, row["origin"])
    listed = [{**{f: None for f in FIGURES}, **s} for s in sorted(steps.values(), key=lambda s: s["step"])]
    return listed[:limit] if limit is not None else listed


def peak_window(store: Store, run_id: str, rank: int = 0) -> int | None:
    """The trace window whose at-peak blocks add up to the most bytes."""
    with store.reader() as r:
        rows = r.execute(
            "SELECT window_id, sum(bytes) AS b FROM memory_blocks WHERE run_id = ? AND rank = ? AND kind = 'at_peak' "
            "GROUP BY window_id ORDER BY b DESC, window_id LIMIT 1",
            [run_id, rank],
        ).fetchall()
    return int(rows[0][0]) if rows else None


def blocks(store: Store, run_id: str, kind: str, window: int | None = None, rank: int = 0) -> list[dict[str, Any]]:
    """Rows of ``memory_blocks`` of one kind (one window, or every window), largest first."""
    sql = (
        "SELECT window_id, kind, bytes, count, device, module, op, shapes, step, ts_ns, method FROM memory_blocks "
        "WHERE run_id = ? AND rank = ? AND kind = ?"
    )
    params: list[Any] = [run_id, rank, kind]
    if window is not None:
        sql += " AND window_id = ?"
        params.append(window)
    with store.reader() as r:
        return _dicts(r.execute(sql + " ORDER BY bytes DESC, window_id, module, op", params))


def by_module(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Bytes per module path, largest first (blocks with no module: "(outside modules)")."""
    sums: dict[str, int] = {}
    for b in rows:
        key = b["module"] or ("(outside modules)" if b["op"] != "(allocated before the window)" else b["op"])
        sums[key] = sums.get(key, 0) + int(b["bytes"])
    return [{"module": m, "bytes": v} for m, v in sorted(sums.items(), key=lambda kv: -kv[1])]


def timeline(store: Store, run_id: str, window: int | None = None, rank: int = 0) -> list[dict[str, Any]]:
    sql = (
        "SELECT window_id, ts_ns, allocated_bytes, reserved_bytes, device, step, method FROM memory_timeline "
        "WHERE run_id = ? AND rank = ?"
    )
    params: list[Any] = [run_id, rank]
    if window is not None:
        sql += " AND window_id = ?"
        params.append(window)
    with store.reader() as r:
        return _dicts(r.execute(sql + " ORDER BY device, ts_ns", params))


def windows(store: Store, run_id: str, rank: int = 0) -> list[int]:
    with store.reader() as r:
        rows = r.execute(
            "SELECT DISTINCT window_id FROM memory_timeline WHERE run_id = ? AND rank = ? ORDER BY window_id",
            [run_id, rank],
        ).fetchall()
    return [int(w[0]) for w in rows]


def oom(store: Store, run_id: str, rank: int = 0) -> dict[str, Any] | None:
    """The out-of-memory record, with XLA's allocation table as ``allocations`` (empty when none)."""
    with store.reader() as r:
        rows = _dicts(r.execute("SELECT * FROM memory_oom WHERE run_id = ? AND rank = ? LIMIT 1", [run_id, rank]))
        if not rows:
            return None
        allocs = _dicts(
            r.execute(
                "SELECT position, size_bytes, shape, operator, unpadded_bytes, padding_bytes, expansion, xla_label, "
                "allocation_type FROM memory_oom_allocs WHERE run_id = ? AND rank = ? ORDER BY position",
                [run_id, rank],
            )
        )
    out = {k: v for k, v in rows[0].items() if k not in ("run_id", "rank")}
    out["allocations"] = allocs
    return out
