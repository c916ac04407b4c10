"""Numerics compared per (op, module): verdict changes, error growth against the fp64 oracle, and the first op
that diverges in B but did not in A.

Status policy (PyTorch's RegressionPolicy): pass → fail is a regression, fail → pass an improvement, fail → fail
a warning.  Error growth follows ``torch._dynamo.utils.same``'s form: B's worst scaled error exceeds
``GROWTH_K`` × A's plus a floor at the level clean ops reach (DESIGN 4.2: ≤ 4 for every clean op).
"""

from __future__ import annotations

from typing import Any

from tpudiag.comparison.snapshot import Snapshot

GROWTH_K = 2.0
GROWTH_FLOOR = 4.0


def _status(entry: dict[str, Any] | None) -> str | None:
    if entry is None or not entry.get("checked"):
        return None
    return "fail" if entry.get("divergent") else "pass"


CHANGES = {
    ("pass", "fail"): "regression",
    (None, "fail"): "regression",
    ("fail", "pass"): "improvement",
    ("fail", None): "improvement",
    ("fail", "fail"): "still failing",
}


def compare_numerics(a: Snapshot, b: Snapshot) -> dict[str, Any] | None:
    """The ``numerics`` section (None when neither run captured numerics)."""
    if a.numerics is None and b.numerics is None:
        return None
    if a.numerics is None or b.numerics is None:
        missing = "A" if a.numerics is None else "B"
        return {
            "comparable": False,
            "note": f"run {missing} has no numerics data",
            "changes": [],
            "first_new_divergence": None,
            "counts": {},
        }
    by_a = {(n["op"], n["module"]): n for n in a.numerics}
    by_b = {(n["op"], n["module"]): n for n in b.numerics}
    changes: list[dict[str, Any]] = []
    for key in list(by_a) + [k for k in by_b if k not in by_a]:
        na, nb = by_a.get(key), by_b.get(key)
        sa, sb = _status(na), _status(nb)
        change = CHANGES.get((sa, sb))
        ea = na.get("max_scaled_error") if na else None
        eb = nb.get("max_scaled_error") if nb else None
        grew = ea is not None and eb is not None and eb > GROWTH_K * ea + GROWTH_FLOOR
        if change is None and grew:
            change = "error growth"
        if change is None:
            continue
        where = nb if sb == "fail" and nb else na or nb or {}
        changes.append(
            {
                "op": key[0],
                "module": key[1],
                "change": change,
                "status_a": sa,
                "status_b": sb,
                "divergent_a": na.get("divergent", 0) if na else 0,
                "divergent_b": nb.get("divergent", 0) if nb else 0,
                "max_scaled_error_a": ea,
                "max_scaled_error_b": eb,
                "source": where.get("first_source"),
                "phase": where.get("first_phase"),
                "seq_b": nb.get("first_seq") if nb else None,
            }
        )
    order = {"regression": 0, "error growth": 1, "still failing": 2, "improvement": 3}
    changes.sort(key=lambda c: (order[c["change"]], c["seq_b"] if c["seq_b"] is not None else 1 << 62))
    new = [c for c in changes if c["change"] == "regression"]
    first = min(new, key=lambda c: c["seq_b"] if c["seq_b"] is not None else 1 << 62) if new else None
    counts: dict[str, int] = {}
    for c in changes:
        counts[c["change"]] = counts.get(c["change"], 0) + 1
    return {
        "comparable": True,
        "checked_a": sum(n["checked"] for n in a.numerics),
        "checked_b": sum(n["checked"] for n in b.numerics),
        "divergent_ops_a": sum(1 for n in a.numerics if n.get("divergent")),
        "divergent_ops_b": sum(1 for n in b.numerics if n.get("divergent")),
        "changes": changes,
        "counts": counts,
        "first_new_divergence": first,
    }
