"""What the step summary needs beyond the steps themselves: the span the trace's ops cover, and tpudiag's own time.

tpudiag's own time inside the script is what the numerics checker spends in its ``tpudiag::`` profiler ranges (the
oracle, the comparisons: ``kineto_tables`` marks them ``tpudiag_overhead``) and the Python work of its dispatch mode
(the self time of torch's ``PythonDispatchMode`` wrapper events).  Both run inside the user's steps, so a step's
wall time holds them; the report shows them apart.
"""

from __future__ import annotations

from tpudiag.store.database import Store

TOOL_RANGE_LIKE = "tpudiag::%"
TOOL_CATEGORY = "tpudiag_overhead"
DISPATCH_WRAPPER = "PythonDispatchMode"
PROFILER_SESSION_CATEGORY = "Trace"  # Kineto's whole-session event: profiler start to stop, not the script's work

_TOOL_EVENTS = """
    SELECT e.start_ns, CASE WHEN e.name = $wrapper THEN e.self_ns ELSE e.dur_ns END AS tool_ns
    FROM trace_events e LEFT JOIN trace_events p ON p.run_id = e.run_id AND p.event_id = e.parent_id
    WHERE e.run_id = $run AND (
        (e.name LIKE $tool AND (p.category IS NULL OR p.category <> $tool_cat)) OR e.name = $wrapper
    )
"""


def op_span_ns(store: Store, run_id: str) -> tuple[int, int] | None:
    """First start and last end of the run's events, leaving out the profiler's own session event."""
    with store.reader() as r:
        row = r.execute(
            "SELECT min(start_ns), max(start_ns + dur_ns) FROM trace_events WHERE run_id = ? AND category <> ?",
            [run_id, PROFILER_SESSION_CATEGORY],
        ).fetchone()
    if not row or row[0] is None:
        return None
    return int(row[0]), int(row[1])


def tool_total_ns(store: Store, run_id: str) -> int:
    """tpudiag's own ns over the whole run."""
    params = {"run": run_id, "tool": TOOL_RANGE_LIKE, "tool_cat": TOOL_CATEGORY, "wrapper": DISPATCH_WRAPPER}
    with store.reader() as r:
        total = r.execute(f"SELECT coalesce(sum(tool_ns), 0) FROM ({_TOOL_EVENTS})", params).fetchone()
    return int(total[0]) if total else 0


def tool_ns_by_step(store: Store, run_id: str) -> tuple[dict[int, int], int]:
    """(step -> tpudiag's own ns inside it, tpudiag's own ns over the whole run)."""
    params = {"run": run_id, "tool": TOOL_RANGE_LIKE, "tool_cat": TOOL_CATEGORY, "wrapper": DISPATCH_WRAPPER}
    with store.reader() as r:
        total = r.execute(f"SELECT coalesce(sum(tool_ns), 0) FROM ({_TOOL_EVENTS})", params).fetchone()
        rows = r.execute(
            f"""
            SELECT s.step, sum(t.tool_ns) FROM steps s JOIN ({_TOOL_EVENTS}) t
              ON t.start_ns >= s.start_ns AND t.start_ns < s.start_ns + s.dur_ns
            WHERE s.run_id = $run GROUP BY s.step
            """,
            params,
        ).fetchall()
    return {int(step): int(ns) for step, ns in rows}, int(total[0]) if total else 0
