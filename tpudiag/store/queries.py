"""Read queries over runs, trace events and steps.

All SQL against the tables lives in this package; callers get plain Python values back.  Filters are always
passed as parameters, never spliced into SQL text.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpudiag.errors import UnknownRunError
from tpudiag.store.database import Store, decode_run

if TYPE_CHECKING:
    import duckdb

# Categories that count as "ops" in the slow-ops ranking.
HOST_OP_CATEGORIES = ("cpu_op", "xla_host_op")  # xla_host_op: HLO ops of XLA's CPU runtime (host threads)
DEVICE_OP_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset", "xla_op")


def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    cols = [d[0] for d in cur.description or []]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def list_runs(store: Store, limit: int | None = None) -> list[dict[str, Any]]:
    """Runs, newest first."""
    with store.reader() as r:
        sql = "SELECT * FROM runs ORDER BY started_at DESC, id DESC"
        params: list[Any] = []
        if limit is not None:
            sql += " LIMIT ?"
            params.append(limit)
        return [decode_run(row) for row in _dicts(r.execute(sql, params))]


def resolve_run(store: Store, ref: str | None) -> dict[str, Any]:
    """A run by id, unique name, or (``ref`` None) the latest run."""
    with store.reader() as r:
        if ref is None:
            rows = _dicts(r.execute("SELECT * FROM runs ORDER BY started_at DESC, id DESC LIMIT 1"))
            if not rows:
                raise UnknownRunError(f"store {store.path} has no runs yet (tpudiag capture script.py)")
            return decode_run(rows[0])
        rows = _dicts(r.execute("SELECT * FROM runs WHERE id = ?", [ref]))
        if not rows:
            rows = _dicts(r.execute("SELECT * FROM runs WHERE name = ? ORDER BY started_at DESC", [ref]))
        if not rows:
            rows = _dicts(r.execute("SELECT * FROM runs WHERE starts_with(id, ?) ORDER BY started_at DESC", [ref]))
    if not rows:
        raise UnknownRunError(f"no run {ref!r} in {store.path} (tpudiag runs lists them)")
    if len(rows) > 1:
        ids = ", ".join(row["id"] for row in rows[:5])
        raise UnknownRunError(f"{ref!r} matches {len(rows)} runs ({ids}); use a run id")
    return decode_run(rows[0])


def has_device_trace(con: duckdb.DuckDBPyConnection, run_id: str) -> bool:
    row = con.execute("SELECT count(*) FROM trace_events WHERE run_id = ? AND on_device", [run_id]).fetchone()
    return bool(row and row[0])


def slow_ops(store: Store, run_id: str, limit: int = 20, by_module: bool = True) -> list[dict[str, Any]]:
    """Ops ranked by self time: device time when the run has a device trace, host time otherwise."""
    with store.reader() as r:
        if has_device_trace(r, run_id):
            return device_slow_ops(r, run_id, limit, by_module)
        group = "name, module" if by_module else "name"
        module_col = "module" if by_module else "NULL AS module"
        # A finished run has its op_summary; a running one is aggregated from its events.
        summary = r.execute("SELECT count(*) FROM op_summary WHERE run_id = ?", [run_id]).fetchall()[0][0]
        table, calls = ("op_summary", "sum(calls)") if summary else ("trace_events", "count(*)")
        rows = _dicts(
            r.execute(
                f"""
                SELECT name, {module_col}, {calls} AS calls,
                       sum(self_ns) / 1e3 AS self_us, sum(dur_ns) / 1e3 AS total_us
                FROM {table}
                WHERE run_id = ? AND list_contains(?, category)
                GROUP BY {group}
                ORDER BY self_us DESC, name, module
                LIMIT ?
                """,
                [run_id, list(HOST_OP_CATEGORIES), limit],
            )
        )
    for row in rows:
        row["time_source"] = "host"
        row["self_us"] = round(float(row["self_us"]), 3)
        row["total_us"] = round(float(row["total_us"]), 3)
    return rows


def device_slow_ops(
    con: duckdb.DuckDBPyConnection, run_id: str, limit: int = 20, by_module: bool = True
) -> list[dict[str, Any]]:
    """Device time ranked by the op users wrote: the launching CPU op of GPU kernels, the framework op of XLA ops.

    Each entry keeps the device side too: how many device ops (kernels / HLO ops) it ran, the one that took the
    most time, and the FLOPs and bytes when the trace has them.  Device events with no known op (e.g. a kernel
    whose launch fell outside the trace) are listed under their own name.
    """
    module_col = "module" if by_module else "NULL"
    rows = _dicts(
        con.execute(
            f"""
            WITH dev AS (
                SELECT coalesce(framework_op, name) AS op, {module_col} AS module, name AS device_op,
                       coalesce(launch_id, event_id) AS launch, self_ns, dur_ns, flops, bytes_accessed
                FROM trace_events
                WHERE run_id = ? AND on_device AND list_contains(?, category)
            ), per_device_op AS (
                SELECT op, module, device_op, count(*) AS n, count(DISTINCT launch) AS launches,
                       sum(self_ns) AS self_ns, sum(dur_ns) AS dur_ns, sum(flops) AS flops,
                       sum(bytes_accessed) AS bytes
                FROM dev GROUP BY op, module, device_op
            )
            SELECT op AS name, module, sum(launches) AS calls, sum(n) AS device_events,
                   count(*) AS device_op_kinds, arg_max(device_op, self_ns) AS top_device_op,
                   sum(self_ns) / 1e3 AS self_us, sum(dur_ns) / 1e3 AS total_us,
                   sum(flops) AS flops, sum(bytes) AS bytes_accessed
            FROM per_device_op
            GROUP BY op, module
            ORDER BY self_us DESC, name, module
            LIMIT ?
            """,
            [run_id, list(DEVICE_OP_CATEGORIES), limit],
        )
    )
    for row in rows:
        row["time_source"] = "device"
        row["calls"] = int(row["calls"])
        row["device_events"] = int(row["device_events"])
        row["self_us"] = round(float(row["self_us"]), 3)
        row["total_us"] = round(float(row["total_us"]), 3)
    return rows


def steps(store: Store, run_id: str) -> list[dict[str, Any]]:
    with store.reader() as r:
        return _dicts(
            r.execute(
                "SELECT step, start_ns, dur_ns, kind, input_shapes, rank FROM steps WHERE run_id = ? "
                "ORDER BY rank, step",
                [run_id],
            )
        )


def trace_counts(store: Store, run_id: str) -> dict[str, int]:
    with store.reader() as r:
        rows = r.execute(
            "SELECT category, count(*) FROM trace_events WHERE run_id = ? GROUP BY category", [run_id]
        ).fetchall()
    return {str(cat): int(n) for cat, n in rows}


def trace_span_ns(store: Store, run_id: str) -> tuple[int, int] | None:
    with store.reader() as r:
        row = r.execute(
            "SELECT min(start_ns), max(start_ns + dur_ns) FROM trace_events WHERE run_id = ?", [run_id]
        ).fetchone()
    if not row or row[0] is None:
        return None
    return int(row[0]), int(row[1])
