"""Per-HLO-op device statistics of XLA runs (XProf's ``hlo_stats``), per chip and per op category.

An HLO op is keyed the way XProf keys it: by its program (``program_id``) and its instruction name, summed over
the chips that ran it.  Self and total time are the device's own spans (``xplane_lines`` reads them from the
events' ``device_offset_ps``/``device_duration_ps``); the ``Async XLA Ops`` line (async copies and collectives,
overlapping compute) is summed apart, since its time is not the chip's busy time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpudiag.store.database import Store

if TYPE_CHECKING:
    import duckdb

XLA_OP_CATEGORY = "xla_op"
HOST_XLA_OP_CATEGORY = "xla_host_op"  # XLA's CPU runtime runs HLO ops on host threads (tf_XLAEigen/...)
HLO_OP_CATEGORIES = [XLA_OP_CATEGORY, HOST_XLA_OP_CATEGORY]
ASYNC_OP_CATEGORY = "xla_async_op"
# HLO categories (``hlo_category`` stat, XProf's names) by what the op spends its time on.
_COLLECTIVE_WORDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective", "send", "recv")
_COPY_WORDS = ("copy", "data formatting", "dynamic-update-slice", "host")


def op_kind(hlo_category: str | None, name: str) -> str:
    """``collective``, ``copy`` or ``compute`` for an HLO op (its category, else its name)."""
    text = (hlo_category or name).lower()
    if any(w in text for w in _COLLECTIVE_WORDS):
        return "collective"
    if any(text.startswith(w) or w == text for w in _COPY_WORDS):
        return "copy"
    return "compute"


def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    cols = [d[0] for d in cur.description or []]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def has_hlo_ops(store: Store, run_id: str) -> bool:
    with store.reader() as r:
        rows = r.execute(
            "SELECT count(*) FROM (SELECT 1 FROM trace_events WHERE run_id = ? AND list_contains(?, category) LIMIT 1)",
            [run_id, HLO_OP_CATEGORIES],
        ).fetchall()
    return bool(rows[0][0])


def hlo_ops(store: Store, run_id: str, limit: int | None = 20) -> list[dict[str, Any]]:
    """HLO ops ranked by device self time (summed over chips), each with its per-chip self time.

    Keys per row: ``program_id``, ``module``, ``name``, ``category`` (HLO category), ``kind``
    (compute / copy / collective), ``occurrences``, ``self_us``, ``total_us``, ``flops``, ``bytes_accessed``,
    ``framework_op``, ``per_device`` ({device: self_us}).
    """
    with store.reader() as r:
        rows = _dicts(
            r.execute(
                """
                WITH ops AS (
                    SELECT coalesce(json_extract_string(args, '$.program_id'), '') AS program_id,
                           json_extract_string(args, '$.hlo_module') AS module, name, hlo_category,
                           framework_op, split_part(process, ':', -2) || ':' || split_part(process, ':', -1) AS device,
                           self_ns, dur_ns, flops, bytes_accessed
                    FROM trace_events WHERE run_id = ? AND list_contains(?, category)
                ), per_device AS (
                    SELECT program_id, name, device, sum(self_ns) AS self_ns
                    FROM ops GROUP BY program_id, name, device
                )
                SELECT o.program_id, any_value(o.module) AS module, o.name, any_value(o.hlo_category) AS category,
                       any_value(o.framework_op) AS framework_op, count(*) AS occurrences,
                       sum(o.self_ns) / 1e3 AS self_us, sum(o.dur_ns) / 1e3 AS total_us,
                       sum(o.flops) AS flops, sum(o.bytes_accessed) AS bytes_accessed,
                       (SELECT map(list(d.device ORDER BY d.device), list(d.self_ns / 1e3 ORDER BY d.device))
                        FROM per_device d WHERE d.program_id = o.program_id AND d.name = o.name) AS per_device
                FROM ops o
                GROUP BY o.program_id, o.name
                ORDER BY self_us DESC, o.name
                """
                + (" LIMIT ?" if limit is not None else ""),
                [run_id, HLO_OP_CATEGORIES, *([limit] if limit is not None else [])],
            )
        )
    for row in rows:
        row["kind"] = op_kind(row["category"], row["name"])
        row["self_us"] = round(float(row["self_us"]), 3)
        row["total_us"] = round(float(row["total_us"]), 3)
        row["flops"] = float(row["flops"]) if row["flops"] is not None else None
        row["bytes_accessed"] = float(row["bytes_accessed"]) if row["bytes_accessed"] is not None else None
        row["per_device"] = {str(k): round(float(v), 3) for k, v in (row["per_device"] or {}).items()}
    return rows


def device_totals(store: Store, run_id: str) -> list[dict[str, Any]]:
    """Per chip: HLO op self time by kind source rows (device, hlo_category, name, self_us), the async line's
    time, and the span from its first to its last op (``span_us``)."""
    with store.reader() as r:
        return _dicts(
            r.execute(
                """
                SELECT split_part(process, ':', -2) || ':' || split_part(process, ':', -1) AS device,
                       category, hlo_category, name, sum(self_ns) / 1e3 AS self_us, sum(dur_ns) / 1e3 AS total_us,
                       min(start_ns) AS first_ns, max(start_ns + dur_ns) AS last_ns
                FROM trace_events WHERE run_id = ? AND list_contains(?, category)
                GROUP BY device, category, hlo_category, name
                ORDER BY device
                """,
                [run_id, [*HLO_OP_CATEGORIES, ASYNC_OP_CATEGORY]],
            )
        )
