"""A comparison as tables: plain text for the terminal, GitHub-flavoured markdown for job summaries and PRs.

Both formats are built from the same rows (``tables``), so they always show the same numbers.
"""

from __future__ import annotations

import json
from typing import Any

from tpudiag.comparison import compile_diff, stats

MAX_OP_ROWS = 20
MAX_NUMERICS_ROWS = 20


def _s(v: float | None) -> str:
    if v is None:
        return "–"
    a = abs(v)
    if a >= 1:
        return f"{v:.3f} s"
    if a >= 1e-3:
        return f"{v * 1e3:.3f} ms"
    return f"{v * 1e6:.1f} µs"


def _ci(ci: list[float] | None) -> str:
    return f"[{_s(ci[0])}, {_s(ci[1])}]" if ci else "–"


def _ratio(r: float | None) -> str:
    return "–" if r is None else f"×{r:.3f}"


def _v(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | dict):
        text = json.dumps(v, default=str)
        return text if len(text) <= 50 else text[:47] + "..."
    return str(v)


Table = tuple[str, list[str], list[list[str]], list[str]]  # title, headers, rows, notes


def tables(result: dict[str, Any]) -> list[Table]:
    out: list[Table] = []
    comp = result["comparable"]
    rows = [[d["field"], _v(d["a"]), _v(d["b"])] for d in comp["differences"]]
    timing = set(comp.get("timing_problems", []))
    notes = [f"not comparable{' for timing' if p in timing else ''}: {p}" for p in comp["problems"]] or [
        "comparable: same script, arguments, input shapes"
    ]
    out.append(("Fingerprint differences", ["field", "A", "B"], rows, notes))

    st = result["steps"]
    rows = []
    for label, key in (("time to first result (step 1)", "first"), ("steady step", "steady")):
        d = st.get(key)
        if d:
            rows.append(
                [
                    label,
                    _s(d["median_a"]),
                    _ci(d["ci_a"]),
                    _s(d["median_b"]),
                    _ci(d["ci_b"]),
                    _ratio(d["ratio"]),
                    _v(d["p_value"]),
                    stats.sample_count(d),
                    d["verdict"],
                ]
            )
    out.append(
        (
            "Steps",
            ["", "median A", "95% CI A", "median B", "95% CI B", "B/A", "p", "n", "verdict"],
            rows,
            [st["note"]] if st.get("note") else [],
        )
    )

    ops = result["ops"]
    entries = [e for e in ops.get("entries", []) if e["category"] != "unchanged"][:MAX_OP_ROWS]
    rows = [
        [
            e["op"],
            e["module"] or "–",
            e["category"],
            _s(e["per_step_s_a"]),
            _s(e["per_step_s_b"]),
            _ratio(e["ratio"]),
            "–" if e["impact"] is None else f"{e['impact'] * 100:+.2f}%",
        ]
        for e in entries
    ]
    counts = ", ".join(f"{n} {c}" for c, n in sorted(ops.get("counts", {}).items()))
    notes = [f"{counts or 'no ops'} ({ops.get('time_source') or 'no'} times, per steady step)"]
    if ops.get("uniform_shift"):
        notes.append(ops["uniform_shift"]["notice"])
    if ops.get("note"):
        notes.append(ops["note"])
    out.append(("Ops (changed)", ["op", "module", "category", "A / step", "B / step", "B/A", "of step"], rows, notes))

    num = result["numerics"]
    if num is not None:
        rows = [
            [
                c["op"],
                c["module"] or "–",
                c["change"],
                f"{c['status_a'] or '–'} → {c['status_b'] or '–'}",
                _v(c["max_scaled_error_a"]),
                _v(c["max_scaled_error_b"]),
                c["source"] or "–",
            ]
            for c in num["changes"][:MAX_NUMERICS_ROWS]
        ]
        notes = [num["note"]] if num.get("note") else []
        first = num.get("first_new_divergence")
        if first:
            notes.append(f"first new divergence: {first['op']} in {first['module'] or '–'} at {first['source']}")
        elif num.get("comparable"):
            notes.append("no new divergence")
        out.append(("Numerics", ["op", "module", "change", "verdict", "error A", "error B", "source"], rows, notes))

    comp_s = result["compile"]
    if comp_s is not None:
        rows = [[k, _v(comp_s[k]["a"]), _v(comp_s[k]["b"])] for k in compile_diff.SHOWN]
        notes = [f"new recompile reason: {r}" for r in comp_s["new_recompile_reasons"]]
        notes += [f"new graph break: {s}" for s in comp_s["new_graph_breaks"]]
        out.append(("Compilation", ["", "A", "B"], rows, notes))
    mem = result.get("memory")
    if mem is not None:
        from tpudiag.memory_report import human_bytes

        ratio = f"×{mem['ratio']:.3f}" if mem["ratio"] else "–"
        notes = [] if mem["same_shapes"] else ["input shapes differ: peaks not compared"]
        rows = [["peak", human_bytes(mem["peak_a"]), human_bytes(mem["peak_b"]), ratio]]
        out.append(("Memory", ["", "A", "B", "B/A"], rows, notes))
    return out


def _text_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def render_text(result: dict[str, Any]) -> str:
    lines = [f"A: {result['a']['name']} ({result['a']['id']})    B: {result['b']['name']} ({result['b']['id']})", ""]
    for title, headers, rows, notes in tables(result):
        lines.append(title)
        if rows:
            lines.extend("  " + r for r in _text_table(headers, rows))
        lines.extend(f"  {n}" for n in notes)
        lines.append("")
    return "\n".join(lines)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(result: dict[str, Any], heading: str = "tpudiag compare") -> str:
    lines = [
        f"## {heading}",
        "",
        f"A: `{result['a']['name']}` ({result['a']['id']}) · B: `{result['b']['name']}` ({result['b']['id']})",
        "",
    ]
    for title, headers, rows, notes in tables(result):
        lines.append(f"### {title}")
        lines.append("")
        if rows:
            lines.append("| " + " | ".join(_md_cell(h) for h in headers) + " |")
            lines.append("|" + "---|" * len(headers))
            lines.extend("| " + " | ".join(_md_cell(c) for c in r) + " |" for r in rows)
            lines.append("")
        lines.extend(f"- {_md_cell(n)}" for n in notes)
        lines.append("")
    return "\n".join(lines)
