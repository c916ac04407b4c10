"""The report's numerics section over every rank of a distributed run.

The run's own numerics tables hold one rank (the lowest of the last attempt); a fault on another rank, averaged
away by DDP before any fingerprint sees it, shows only in that rank's op diffs.  This section is the single-run
section (``tpudiag.numerics_report``) with its divergent ops taken from every rank (``dist_op_diffs``):

- every divergent op carries its ``rank``; the list is in (seq, rank) order, so the first divergence is the
  earliest across ranks (ranks run the same program, so a seq is the same point of it on each);
- ``ranks`` says which ranks diverge and which agree, with one line of text
  (``rank 2 only: aten::tanh in module.1 (forward), seq 12; ranks 0, 1 agree``);
- the counts of divergent op calls are over every rank.

For a single-process run the section is the single-run one, unchanged.
"""

from __future__ import annotations

from typing import Any

from tpudiag import numerics_report
from tpudiag.display import short_source
from tpudiag.distributed.children import MISSED_MARK
from tpudiag.store import Store
from tpudiag.store import rank_numerics_queries as q

UNCAPTURED_MARK = MISSED_MARK  # in the run's note about the Python processes tpudiag did not reach


def _ranks_list(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(str(r) for r in ranks)


def rank_summary(
    entries: list[dict[str, Any]], coverage: dict[int, dict[str, int]], world: list[int]
) -> dict[str, Any] | None:
    """Which ranks diverge (and where first) and which agree, from every rank's divergent entries (pure)."""
    ranks = sorted(set(world) | set(coverage) | {int(e["rank"]) for e in entries})
    if len(ranks) < 2:
        return None
    firsts: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        first = numerics_report.first_divergence([e for e in entries if e["rank"] == rank])
        if first is not None and first["verdict"] in ("fail", "overflow"):
            firsts[rank] = first
    diverging = sorted(firsts)
    agreeing = [r for r in ranks if r not in firsts]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank in diverging:
        f = firsts[rank]
        groups.setdefault((f["op"], f["module"], f["phase"]), []).append(rank)
    parts = []
    for (op, module, phase), members in groups.items():
        who = _ranks_list(members)
        if len(groups) == 1:
            who = "every rank" if len(members) == len(ranks) else who + " only"
        f = firsts[members[0]]
        parts.append(f"{who}: {op} in {module or '(no module)'} ({phase}), seq {f['seq']}")
    if agreeing:
        verb = "agrees" if len(agreeing) == 1 else "agree"
        parts.append(f"{_ranks_list(agreeing)} {verb} (no divergent op)" if diverging else "every rank agrees")
    per_rank = [
        {
            "rank": r,
            **coverage.get(r, {"checked": None, "divergent": None, "expected_precision": None}),
            "first_divergence": (
                {"seq": firsts[r]["seq"], "op": firsts[r]["op"], "module": firsts[r]["module"]} if r in firsts else None
            ),
        }
        for r in ranks
    ]
    return {"diverging": diverging, "agreeing": agreeing, "per_rank": per_rank, "text": "; ".join(parts)}


def _counts(entries: list[dict[str, Any]]) -> dict[str, int]:
    seen: dict[str, set[tuple[int, int]]] = {}
    for e in entries:
        what = e["role"] or e["verdict"]
        seen.setdefault(str(what), set()).add((int(e["rank"]), int(e["seq"])))
    return {k: len(v) for k, v in seen.items()}


def build_section(store: Store, run: dict[str, Any]) -> dict[str, Any] | None:
    section = numerics_report.build_section(store, run)
    if section is None:
        return None
    with store.reader() as con:
        attempt = q.last_attempt(con, run["id"])
        if attempt is None:
            return _uncaptured(section, run)
        rows = q.rank_outputs(con, run["id"], attempt)
        coverage = q.rank_coverage(con, run["id"], attempt)
        world = [int(r[0]) for r in con.execute(
            "SELECT rank FROM dist_ranks WHERE run_id = ? AND restart = ?", [run["id"], attempt]
        ).fetchall()]  # fmt: skip
    if not world:
        return _uncaptured(section, run)
    entries = []
    for row in _one_per_rank_op(rows):
        entry = numerics_report._entry(row)
        entry["rank"] = int(row["rank"])
        entry["source_short"] = short_source(entry["source"], run.get("script"))
        if row.get("repro_path"):
            entry["repro"] = f"tpudiag repro {run['id']} {row['seq']} --rank {row['rank']}"
        entries.append(entry)
    section["divergent_ops"] = entries[: numerics_report.MAX_LISTED]
    section["first_divergence"] = numerics_report.first_divergence(entries)
    section["coverage"]["divergent"] = _counts(entries)
    section["coverage"]["rank"] = min(world)  # the rank whose coverage the section's counts are
    section["ranks"] = rank_summary(entries, coverage, world)
    return _uncaptured(section, run)


def _one_per_rank_op(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (rank, op call), in (seq, rank) order (``numerics_report._one_per_op`` per rank)."""
    by_rank: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        by_rank.setdefault(int(row["rank"]), []).append(row)
    picked = [r for items in by_rank.values() for r in numerics_report._one_per_op(items)]
    return sorted(picked, key=lambda r: (int(r["seq"]), int(r["rank"])))


def _uncaptured(section: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """No ops seen because the work ran in processes tpudiag did not reach: say that, not "nothing was checked"."""
    missed = next((n for n in run.get("notes") or [] if UNCAPTURED_MARK in n), None)
    cov = section["coverage"]
    if missed and cov.get("ops_seen") == 0:
        cov["warning"] = (
            "no aten ops in the captured process: the Python worker processes it started were not captured (see notes)"
        )
    return section


def render_section(section: dict[str, Any]) -> list[str]:
    lines = numerics_report.render_section(section)
    ranks = section.get("ranks")
    if not ranks:
        return lines
    extra = [f"  across ranks: {ranks['text']}"]
    per_rank = [
        f"rank {r['rank']}: {r['divergent']} of {r['checked']} divergent"
        for r in ranks["per_rank"]
        if r.get("checked") is not None
    ]
    if per_rank:
        extra.append("  checked per rank: " + ", ".join(per_rank))
    rank = section["coverage"].get("rank", 0)
    extra.append(f"  (coverage and skips below are rank {rank}'s; the divergent ops are every rank's)")
    return [lines[0], *extra, *lines[1:]]
