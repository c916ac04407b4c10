"""The cross-rank questions, as pure functions over per-rank records (no store, no torch, inputs not mutated).

- ``stragglers``: the rank that arrives last at collectives.  In a synchronous job every rank's step takes as
  long as the slowest one's (the collective makes them wait), so step times do not name it; the time *inside* each
  collective does: the late rank waits least, the others wait for it.
- ``collective_mismatch``: the first collective where ranks disagree on the op, its shapes or dtypes, or where a
  rank is missing.
- ``rank_divergence``: the first step where a rank's parameter or gradient fingerprint differs from the reference
  ranks' (the largest group of equal fingerprints; ties go to the group holding the lowest rank).
- ``compile_divergence``: ranks that compiled, recompiled or broke graphs differently from the others.
- ``step_spread`` and ``first_failure``: step time per rank, and which rank failed first and why.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpudiag.distributed.records import Collective, Fingerprint
from tpudiag.model import CompileEvent

# A rank counts as late at a collective when the others waited at least this much longer than it did, both as a
# fraction of their wait and in absolute time (below it, scheduling noise).
LATE_FRACTION = 0.5
LATE_MIN_NS = 50_000
CHRONIC_FRACTION = 0.5
COMPILE_KINDS = ("compile", "recompile", "backward_compile", "graph_break", "tpu_graph")


def _s(ns: float) -> float:
    return round(ns / 1e9, 6)


def _by_rank(collectives: Iterable[Collective]) -> dict[int, list[Collective]]:
    out: dict[int, list[Collective]] = defaultdict(list)
    for c in collectives:
        out[c.rank].append(c)
    for items in out.values():
        items.sort(key=lambda c: c.seq)
    return dict(out)


def _signature(c: Collective) -> tuple[str, str | None, str | None]:
    return (c.op, c.shapes, c.dtypes)


def collective_mismatch(
    collectives: Iterable[Collective], all_ranks: Iterable[int] | None = None
) -> dict[str, Any] | None:
    """The first collective (by ``seq``) where the ranks' (op, shapes, dtypes) differ or a rank is missing.

    ``all_ranks``: the ranks of the job, when ``collectives`` holds only some seqs (a rank absent there is missing).
    """
    per_rank: dict[int, dict[int, Collective]] = defaultdict(dict)
    for c in collectives:
        per_rank[c.rank][c.seq] = c
    ranks_all = sorted(set(per_rank) | set(all_ranks or ()))
    if len(ranks_all) < 2:
        return None
    for seq in sorted({s for items in per_rank.values() for s in items}):
        groups: dict[tuple[str, str | None, str | None] | None, list[int]] = defaultdict(list)
        for rank in ranks_all:
            item = per_rank.get(rank, {}).get(seq)
            groups[_signature(item) if item is not None else None].append(rank)
        if len(groups) == 1:
            continue
        ordered = sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0]))
        sides: list[dict[str, Any]] = []
        for sig, ranks in ordered:
            if sig is None:
                sides.append({"ranks": ranks, "op": None, "shapes": None, "dtypes": None, "missing": True})
            else:
                sides.append(
                    {
                        "ranks": ranks,
                        "op": sig[0],
                        "shapes": json.loads(sig[1]) if sig[1] else None,
                        "dtypes": json.loads(sig[2]) if sig[2] else None,
                        "missing": False,
                    }
                )
        text = " vs ".join(
            f"rank{'s' if len(s['ranks']) > 1 else ''} {','.join(map(str, s['ranks']))} "
            + ("never ran it" if s["missing"] else f"{s['op']} {json.dumps(s['shapes'])}")
            for s in sides
        )
        return {"seq": seq, "sides": sides, "ranks": sorted(r for s in sides for r in s["ranks"]), "text": text}
    return None


@dataclass(frozen=True)
class Lateness:
    """One collective: the rank that waited least in it, and the median wait of the others."""

    seq: int
    rank: int
    rank_ns: float
    others_ns: float


def lateness(collectives: Iterable[Collective], count: int) -> list[Lateness]:
    """Per collective ``seq < count``: who arrived last (least wait; ties: lowest rank).

    ``tpudiag.store.distributed_queries.lateness`` computes the same rows in SQL for big jobs.
    """
    durs: dict[int, dict[int, float]] = defaultdict(dict)
    for c in collectives:
        if c.seq < count:
            durs[c.seq][c.rank] = float(c.dur_ns or 0)
    out = []
    for seq in sorted(durs):
        by_rank = durs[seq]
        if len(by_rank) < 2:
            continue
        last = min(by_rank, key=lambda r: (by_rank[r], r))
        others = statistics.median(d for r, d in by_rank.items() if r != last)
        out.append(Lateness(seq, last, by_rank[last], others))
    return out


def stragglers_from(late: Iterable[Lateness], count: int, waits: Mapping[int, float]) -> list[dict[str, Any]]:
    """Stragglers from per-collective lateness over ``count`` collectives; ``waits``: each rank's time in them."""
    hits_by_rank: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for row in late:
        gap = row.others_ns - row.rank_ns
        if gap >= LATE_MIN_NS and gap >= LATE_FRACTION * row.others_ns:
            hits_by_rank[row.rank].append((row.seq, gap))
    out: list[dict[str, Any]] = []
    for rank, hits in hits_by_rank.items():
        fraction = len(hits) / count if count else 0.0
        kind = "chronic" if fraction >= CHRONIC_FRACTION else ("one-off" if len(hits) == 1 else "intermittent")
        out.append(
            {
                "rank": rank,
                "wait_s": _s(waits.get(rank, 0.0)),
                "others_waited_s": _s(sum(g for _, g in hits)),
                "late_at": len(hits),
                "collectives": count,
                "kind": kind,
                "worst_seq": max(hits, key=lambda h: h[1])[0],
                "worst_gap_s": _s(max(g for _, g in hits)),
            }
        )
    out.sort(key=lambda s: (-s["others_waited_s"], s["rank"]))
    return out


def paired_count(counts: Iterable[int], mismatch: Mapping[str, Any] | None) -> int:
    """How many collectives pair up across ranks: the fewest any rank ran, and none from a mismatch on."""
    values = list(counts)
    count = min(values) if values else 0
    return min(count, int(mismatch["seq"])) if mismatch is not None else count


def stragglers(collectives: Iterable[Collective]) -> list[dict[str, Any]]:
    """Ranks that arrived last at collectives, worst first (most time the others spent waiting for them)."""
    items = list(collectives)
    per_rank = _by_rank(items)
    if len(per_rank) < 2:
        return []
    count = paired_count((len(v) for v in per_rank.values()), collective_mismatch(items))
    waits = {r: sum(float(c.dur_ns or 0) for c in v if c.seq < count) for r, v in per_rank.items()}
    return stragglers_from(lateness(items, count), count, waits)


def _reference(groups: Mapping[str, list[int]]) -> str:
    return min(groups, key=lambda k: (-len(groups[k]), min(groups[k])))


def rank_divergence(
    fingerprints: Iterable[Fingerprint], all_ranks: Iterable[int] | None = None
) -> dict[str, Any] | None:
    """Ranks whose fingerprints leave the reference group, each with the first step and kind where it did.

    ``all_ranks``: every rank that has fingerprints, when ``fingerprints`` holds only the cells where ranks
    disagree (the report's SQL sends only those); default: the ranks in ``fingerprints``.
    """
    cells: dict[tuple[int, int], dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    sums: dict[tuple[int, int, int], float | None] = {}
    for f in fingerprints:
        key = (f.step, 0 if f.kind == "grad" else 1)
        cells[key][f.fingerprint].append(f.rank)
        sums[(*key, f.rank)] = f.abs_sum
    diverged: dict[int, dict[str, Any]] = {}
    first: tuple[int, int] | None = None
    for key in sorted(cells):
        groups = cells[key]
        if len(groups) < 2:
            continue
        ref = _reference(groups)
        ref_rank = min(groups[ref])
        first = first or key
        for digest, members in groups.items():
            if digest == ref:
                continue
            for rank in members:
                entry = diverged.setdefault(
                    rank,
                    {
                        "rank": rank,
                        "from_step": key[0],
                        "kind": "grad" if key[1] == 0 else "param",
                        "abs_sum": sums.get((*key, rank)),
                        "reference_abs_sum": sums.get((*key, ref_rank)),
                        "divergent_fingerprints": 0,
                    },
                )
                entry["divergent_fingerprints"] += 1
    if first is None:
        return None
    ranks: list[dict[str, Any]] = sorted(diverged.values(), key=lambda d: (d["from_step"], d["rank"]))
    seen = {r for groups in cells.values() for rs in groups.values() for r in rs}
    reference = sorted((seen | set(all_ranks or ())) - set(diverged))
    names = ", ".join(str(d["rank"]) for d in ranks)
    lead = "only rank" if len(ranks) == 1 else "ranks"
    return {
        "first_step": first[0],
        "kind": "grad" if first[1] == 0 else "param",
        "ranks": ranks,
        "reference_ranks": reference,
        "text": f"{lead} {names} diverge{'s' if len(ranks) == 1 else ''} from the others, from step "
        f"{ranks[0]['from_step']} ({ranks[0]['kind']}s)",
    }


def _compile_signature(e: CompileEvent) -> str:
    return f"{e.kind} {e.function or '?'} {e.shapes or ''}".strip()


def compile_divergence(events: Iterable[CompileEvent]) -> dict[str, Any] | None:
    """Ranks whose compiles, recompiles or graph breaks differ from the reference ranks'."""
    per_rank: dict[int, Counter[str]] = defaultdict(Counter)
    kinds: dict[int, Counter[str]] = defaultdict(Counter)
    for e in events:
        if e.kind in COMPILE_KINDS:
            per_rank[e.rank][_compile_signature(e)] += 1
            kinds[e.rank][e.kind] += 1
    if len(per_rank) < 2:
        return None
    groups: dict[str, list[int]] = defaultdict(list)
    for rank, sigs in per_rank.items():
        groups[json.dumps(sorted(sigs.items()))].append(rank)
    if len(groups) < 2:
        return None
    ref_key = _reference(groups)
    ref = per_rank[min(groups[ref_key])]
    ranks: list[dict[str, Any]] = []
    for rank in sorted(per_rank):
        if rank in groups[ref_key]:
            continue
        mine = per_rank[rank]
        ranks.append(
            {
                "rank": rank,
                **{k: kinds[rank].get(k, 0) for k in ("compile", "recompile", "graph_break")},
                "only_here": sorted((mine - ref).elements())[:5],
                "missing_here": sorted((ref - mine).elements())[:5],
            }
        )
    reference = sorted(groups[ref_key])
    return {
        "ranks": ranks,
        "reference_ranks": reference,
        "reference": {k: kinds[reference[0]].get(k, 0) for k in ("compile", "recompile", "graph_break")},
    }


def step_spread(durations: Mapping[int, Sequence[int]]) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for rank, durs in durations.items():
        if not durs:
            continue
        out[rank] = {
            "steps": len(durs),
            "step_median_s": _s(statistics.median(durs)),
            "step_min_s": _s(min(durs)),
            "step_max_s": _s(max(durs)),
        }
    return out


def first_failure(ranks: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The rank that failed first (earliest end among failed ranks; a rank lost without a record comes after)."""
    failed = [r for r in ranks if r.get("status") in ("failed", "lost")]
    if not failed:
        return None
    first = min(
        failed,
        key=lambda r: (r.get("status") == "lost", r.get("ended_at") or float("inf"), int(r["rank"])),
    )
    return {
        "rank": int(first["rank"]),
        "attempt": int(first.get("restart") or 0),
        "status": first.get("status"),
        "exit_code": first.get("exit_code"),
        "error": first.get("error"),
    }
