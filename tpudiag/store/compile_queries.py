"""Read queries over compile_events (compiles, recompiles, graph breaks, caches, TorchTPU executable cache).

Dynamo-level events are few (one per compilation, cache lookup or graph break) and come back as records; the
TorchTPU eager cache can log one event per materialisation, so it is aggregated in SQL.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tpudiag.model import CompileEvent, column_names
from tpudiag.store.database import Store

TOP_TPU_OPS = 10


def compile_events(store: Store, run_id: str, exclude_kinds: tuple[str, ...] = ("tpu_eager",)) -> list[CompileEvent]:
    """The run's compile events except the (possibly numerous) excluded kinds, in emission order per rank."""
    names = column_names(CompileEvent)
    cols = ", ".join(f'"{n}"' for n in names)
    with store.reader() as r:
        rows = r.execute(
            f"SELECT {cols} FROM compile_events WHERE run_id = ? AND NOT list_contains(?, kind) ORDER BY rank, seq",
            [run_id, list(exclude_kinds)],
        ).fetchall()
    return [CompileEvent(**dict(zip(names, row, strict=True))) for row in rows]


def count_by_kind(store: Store, run_id: str) -> dict[str, int]:
    with store.reader() as r:
        rows = r.execute(
            "SELECT kind, count(*) FROM compile_events WHERE run_id = ? GROUP BY kind", [run_id]
        ).fetchall()
    return {str(k): int(n) for k, n in rows}


@dataclasses.dataclass(frozen=True)
class TpuEagerSummary:
    events: int
    hits: int
    misses: int
    failed: int
    duration_s: float
    reasons: dict[str, int]
    top_ops: list[dict[str, Any]]


def tpu_eager_summary(store: Store, run_id: str, top: int = TOP_TPU_OPS) -> TpuEagerSummary | None:
    """TorchTPU eager executable-cache lookups: totals, materialisation reasons, the ops that miss most."""
    with store.reader() as r:
        total = r.execute(
            """
            SELECT count(*), count(*) FILTER (WHERE cache_hit), count(*) FILTER (WHERE NOT cache_hit),
                   count(*) FILTER (WHERE failed), coalesce(sum(duration_s), 0)
            FROM compile_events WHERE run_id = ? AND kind = 'tpu_eager'
            """,
            [run_id],
        ).fetchone()
        if not total or not total[0]:
            return None
        reasons = r.execute(
            "SELECT coalesce(reason, '?'), count(*) AS n FROM compile_events "
            "WHERE run_id = ? AND kind = 'tpu_eager' GROUP BY 1 ORDER BY n DESC, 1",
            [run_id],
        ).fetchall()
        ops = r.execute(
            """
            SELECT coalesce(function, '?') AS op, count(*) AS events,
                   count(*) FILTER (WHERE NOT cache_hit) AS misses, count(*) FILTER (WHERE cache_hit) AS hits,
                   count(*) FILTER (WHERE failed) AS failed, coalesce(sum(duration_s), 0) AS duration_s
            FROM compile_events WHERE run_id = ? AND kind = 'tpu_eager'
            GROUP BY 1 ORDER BY misses DESC, events DESC, op LIMIT ?
            """,
            [run_id, top],
        ).fetchall()
    return TpuEagerSummary(
        events=int(total[0]),
        hits=int(total[1]),
        misses=int(total[2]),
        failed=int(total[3]),
        duration_s=float(total[4]),
        reasons={str(k): int(n) for k, n in reasons},
        top_ops=[
            {
                "op": op,
                "events": int(n),
                "misses": int(m),
                "hits": int(h),
                "failed": int(f),
                "duration_s": round(float(d), 6),
            }
            for op, n, m, h, f, d in ops
        ],
    )
