"""Read queries behind ``tpudiag compare`` / ``check``: one run's steps, per-step op times, numerics per op.

Everything a comparison needs is aggregated here, in one short read-only connection per run, into plain Python
values (the comparison package builds its snapshot from them and never sees SQL).
"""

from __future__ import annotations

import json
from typing import Any

from tpudiag.store import rank_numerics_queries
from tpudiag.store.database import Store
from tpudiag.store.queries import DEVICE_OP_CATEGORIES, HOST_OP_CATEGORIES, _dicts, has_device_trace

FAIL_VERDICTS = ("fail", "overflow")
OVERHEAD_CATEGORY = "tpudiag_overhead"  # the numerics checker's own work, recorded in the trace


def _pulse_steps(con: Any, run_id: str, traced: int) -> list[dict[str, Any]] | None:
    """Every step from the pulse (long runs trace only windows of steps, the pulse times them all), in the steps
    table's form; None when the pulse holds no more steps than the trace (short scripts: the trace's steps)."""
    rows = con.execute(
        "SELECT step, start_ns, dur_ns, shapes FROM pulse WHERE run_id = ? AND rank = 0 ORDER BY start_ns, step",
        [run_id],
    ).fetchall()
    if len(rows) <= traced:
        return None

    def compact(shapes: str | None) -> str | None:  # the steps table's spelling: [[16,32]]
        return None if shapes is None else json.dumps(json.loads(shapes), separators=(",", ":"))

    return [
        {
            "step": int(r[0]),
            "start_ns": int(r[1]),
            "dur_ns": int(r[2]),
            "kind": "optimizer",
            "input_shapes": compact(r[3]),
        }
        for r in rows
    ]


def run_material(store: Store, run_id: str, max_ops: int) -> dict[str, Any]:
    """Steps, op times per step (top ``max_ops`` ops by self time) and numerics per op of one run."""
    with store.reader() as con:
        steps = _dicts(
            con.execute(
                "SELECT step, start_ns, dur_ns, kind, input_shapes FROM steps WHERE run_id = ? AND rank = 0 "
                "ORDER BY start_ns, step",
                [run_id],
            )
        )
        steps = _pulse_steps(con, run_id, len(steps)) or steps
        # Steps during which the numerics checker worked: their times measure tpudiag, not the script.
        checked = con.execute(
            "SELECT DISTINCT step FROM trace_events WHERE run_id = ? AND category = ? AND step IS NOT NULL",
            [run_id, OVERHEAD_CATEGORY],
        ).fetchall()
        device = has_device_trace(con, run_id)
        if device:
            events = f"""
                SELECT coalesce(framework_op, name) AS name, module, step, self_ns, shapes FROM trace_events
                WHERE run_id = ? AND on_device AND list_contains({list(DEVICE_OP_CATEGORIES)!r}, category)
            """
        else:
            events = f"""
                SELECT name, module, step, self_ns, shapes FROM trace_events
                WHERE run_id = ? AND list_contains({list(HOST_OP_CATEGORIES)!r}, category)
            """
        ops = _dicts(
            con.execute(
                f"""
                WITH ev AS ({events}),
                top AS (
                    SELECT name, module, count(*) AS calls, sum(self_ns) AS self_ns,
                           list(DISTINCT shapes ORDER BY shapes) FILTER (WHERE shapes IS NOT NULL)[:3] AS shapes
                    FROM ev GROUP BY name, module ORDER BY self_ns DESC, name, module LIMIT ?
                ),
                per_step AS (
                    SELECT name, module, step, sum(self_ns) AS ns FROM ev WHERE step IS NOT NULL
                    GROUP BY name, module, step
                )
                SELECT t.name, t.module, t.calls, t.self_ns, t.shapes,
                       list([p.step, p.ns] ORDER BY p.step) FILTER (WHERE p.step IS NOT NULL) AS per_step
                FROM top t LEFT JOIN per_step p
                  ON p.name = t.name AND p.module IS NOT DISTINCT FROM t.module
                GROUP BY ALL ORDER BY t.self_ns DESC, t.name, t.module
                """,
                [run_id, max_ops],
            )
        )
        total = con.execute(f"SELECT count(*), coalesce(sum(self_ns), 0) FROM ({events})", [run_id]).fetchall()[0]
        numerics = _dicts(
            con.execute(
                """
                WITH per_call AS (
                    SELECT o.seq, o.op, o.module, o.phase, o.source_loc, o.dtypes,
                           bool_or(list_contains(?, d.verdict)) AS failed,
                           bool_or(d.verdict = 'expected_precision') AS expected,
                           max(d.scaled_error) AS scaled_error
                    FROM ops o JOIN op_diffs d ON d.run_id = o.run_id AND d.seq = o.seq
                    WHERE o.run_id = ? AND o.checked AND d.verdict <> 'skip'
                    GROUP BY ALL
                )
                SELECT op, module, count(*) AS checked, count(*) FILTER (WHERE failed) AS divergent,
                       count(*) FILTER (WHERE expected) AS expected_precision,
                       max(scaled_error) AS max_scaled_error,
                       min(seq) FILTER (WHERE failed) AS first_seq,
                       arg_min(source_loc, seq) FILTER (WHERE failed) AS first_source,
                       arg_min(phase, seq) FILTER (WHERE failed) AS first_phase,
                       min(seq) AS seq
                FROM per_call GROUP BY op, module ORDER BY seq
                """,
                [list(FAIL_VERDICTS), run_id],
            )
        )
        has_ops = con.execute("SELECT count(*) FROM ops WHERE run_id = ?", [run_id]).fetchall()[0][0]
        numerics = rank_numerics_queries.numerics_over_ranks(con, run_id) or numerics  # a job: every rank's
    return {
        "steps": steps,
        "checker_steps": sorted(int(r[0]) for r in checked),
        "time_source": "device" if device else ("host" if total[0] else None),
        "op_events": int(total[0]),
        "op_self_ns": int(total[1]),
        "ops": ops,
        "numerics": numerics,
        "has_numerics": bool(has_ops),
    }
