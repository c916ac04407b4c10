"""The ``distributed`` section of ``tpudiag report``: per-rank rows and the cross-rank findings.

``None`` for a run that is not a distributed job.  Reads only the per-rank tables (``dist_*``), never the events,
so its cost grows with ranks times collectives, not with trace size.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from tpudiag.distributed import analysis
from tpudiag.distributed.identity import chip_of
from tpudiag.store import Store
from tpudiag.store import distributed_queries as q

RANK_KEYS = ("rank", "local_rank", "host", "pid", "status", "exit_code", "error", "device", "backend")
MAX_RANKS_LISTED = 16

if TYPE_CHECKING:
    import duckdb


def build_section(store: Store, run: dict[str, Any]) -> dict[str, Any] | None:
    with store.reader() as con:
        if not q.has_tables(con):
            return None
        return section_from(con, run["id"])


def section_from(con: duckdb.DuckDBPyConnection, run_id: str) -> dict[str, Any] | None:
    """The section from the ``dist_*`` tables of ``con`` (a store, or ``tpudiag.remote.reader``'s in-memory
    database over a bucket)."""
    infos = q.ranks(con, run_id)
    if not infos:
        return None
    last = max(int(r["restart"]) for r in infos)
    # Collectives are aggregated in SQL (ranks x collectives rows never come to Python); the pure functions
    # of ``analysis`` get the few rows they decide on.
    counts = q.collective_counts(con, run_id, last)
    ranks = [int(r["rank"]) for r in infos if int(r["restart"]) == last]
    mismatch = analysis.collective_mismatch(q.first_mismatch(con, run_id, last), all_ranks=ranks)
    paired = analysis.paired_count((c["collectives"] for c in counts.values()), mismatch) if counts else 0
    stragglers = analysis.stragglers_from(
        q.lateness(con, run_id, last, paired), paired, q.waits_before(con, run_id, last, paired)
    )
    # Only the cells where ranks disagree, and per-rank step figures: nothing ranks x steps comes to Python.
    divergence = analysis.rank_divergence(
        q.divergent_fingerprints(con, run_id, last), all_ranks=q.fingerprint_ranks(con, run_id, last)
    )
    spread = q.step_spread(con, run_id, last)
    compiles = q.compile_events(con, run_id, last)
    return assemble(infos, counts, mismatch, stragglers, divergence, spread, compiles)


def assemble(
    infos: list[dict[str, Any]],
    counts: dict[int, dict[str, Any]],
    mismatch: dict[str, Any] | None,
    stragglers: list[dict[str, Any]],
    divergence: dict[str, Any] | None,
    spread: dict[int, dict[str, Any]],
    compiles: list[Any],
) -> dict[str, Any]:
    """The section from per-rank records and the collective findings (pure: the store reads are in
    ``build_section``)."""
    last = max(int(r["restart"]) for r in infos)
    current = [r for r in infos if int(r["restart"]) == last]
    ranks = []
    for r in current:
        row = {k: r.get(k) for k in RANK_KEYS}
        row["attempt"] = last
        row["chip"] = chip_of(r.get("device_ids"), int(r["rank"]))  # TorchTPU's rank -> chip; None elsewhere
        row["numerics_checked"] = r.get("numerics_checked")  # outputs compared with the oracle on this rank
        row["numerics_failures"] = r.get("numerics_failures")  # of which failing
        row.update(spread.get(int(r["rank"]), {"steps": 0}))
        row.update(counts.get(int(r["rank"]), {"collectives": 0, "collective_s": 0.0, "collective_bytes": 0}))
        ranks.append(row)
    attempts = []
    for attempt in sorted({int(r["restart"]) for r in infos}):
        rows = [r for r in infos if int(r["restart"]) == attempt]
        failure = analysis.first_failure(rows)
        attempts.append(
            {
                "attempt": attempt,
                "ranks": len(rows),
                "status": "failed" if failure else ("ok" if all(r["status"] == "ok" for r in rows) else "interrupted"),
                "first_failure": failure,
            }
        )
    world = max((int(r["world_size"] or 0) for r in current), default=0) or len(current)
    backends = sorted({r["backend"] for r in current if r.get("backend")})
    return {
        "world_size": world,
        "backend": backends[0] if len(backends) == 1 else (backends or None),
        "hosts": sorted({r["host"] for r in current if r.get("host")}),
        "attempts": attempts,
        "first_failure": attempts[-1]["first_failure"],
        "ranks": ranks,
        "stragglers": stragglers,
        "collective_mismatch": mismatch,
        "rank_divergence": divergence,
        "compile_divergence": analysis.compile_divergence(compiles),
    }


def numerics_cell(row: dict[str, Any]) -> str:
    """The rank table's numerics column: failing outputs of those compared, or ``-`` (not checked)."""
    checked, failures = row.get("numerics_checked"), row.get("numerics_failures")
    if not checked:
        return "-"
    return f"{failures or 0} fail/{checked}" if failures else f"ok/{checked}"


def render_section(section: dict[str, Any]) -> list[str]:
    backend = section["backend"] if isinstance(section["backend"], str) else json.dumps(section["backend"])
    lines = [
        f"distributed: {section['world_size']} ranks on {len(section['hosts'])} host(s), backend {backend}, "
        f"{len(section['attempts'])} attempt(s)"
    ]
    for a in section["attempts"]:
        f = a["first_failure"]
        if f:
            code = f" (exit {f['exit_code']})" if f.get("exit_code") is not None else ""
            lines.append(f"  attempt {a['attempt']}: rank {f['rank']} {f['status']} first{code}: {f['error'] or '-'}")
    header = "  rank  status       steps  step median  collectives  in collectives  numerics        host"
    lines.append(header)
    for r in section["ranks"][:MAX_RANKS_LISTED]:
        median = f"{r['step_median_s']:.4f} s" if r.get("step_median_s") is not None else "-"
        lines.append(
            f"  {r['rank']:>4}  {r['status'] or '-':<11}  {r['steps']:>5}  {median:>11}  {r['collectives']:>11}  "
            f"{r['collective_s']:>12.4f} s  {numerics_cell(r):<14}  {r['host'] or '-'}"
            + (f"  chip {r['chip']}" if r.get("chip") is not None else "")
        )
    if len(section["ranks"]) > MAX_RANKS_LISTED:
        lines.append(f"  ... {len(section['ranks']) - MAX_RANKS_LISTED} more ranks (report --json lists all)")
    if section["stragglers"]:
        lines.append("  stragglers (arrive last at collectives; the others wait for them):")
        for s in section["stragglers"][:5]:
            lines.append(
                f"    rank {s['rank']}: {s['kind']}, last at {s['late_at']}/{s['collectives']} collectives, "
                f"others waited {s['others_waited_s']:.4f} s for it (it waited {s['wait_s']:.4f} s)"
            )
    else:
        lines.append("  stragglers: none (no rank arrived clearly last at collectives)")
    m = section["collective_mismatch"]
    lines.append(
        f"  collective mismatch at collective #{m['seq']}: {m['text']}"
        if m
        else "  collectives: every rank ran the same sequence"
    )
    d = section["rank_divergence"]
    failing = [r["rank"] for r in section["ranks"] if r.get("numerics_failures")]
    if d:
        lines.append(f"  numerics across ranks: {d['text']}")
    elif failing:  # DDP averages gradients: equal fingerprints do not mean equal numbers on every rank
        lines.append(
            "  numerics across ranks: parameter fingerprints agree, but ops diverged from the oracle on "
            + ("rank " if len(failing) == 1 else "ranks ")
            + ", ".join(str(r) for r in failing)
            + " (see numerics)"
        )
    else:
        lines.append("  numerics across ranks: fingerprints agree")
    c = section["compile_divergence"]
    if c:
        for r in c["ranks"][:5]:
            lines.append(
                f"  compile divergence: rank {r['rank']} compiled {r['compile']}, recompiled {r['recompile']}, "
                f"broke {r['graph_break']} graph(s) vs {c['reference']} on ranks {c['reference_ranks']}"
            )
    return lines
