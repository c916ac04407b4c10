"""The report's ``pulse`` and ``windows`` sections (issue 21): the whole-run timeline from the pulse, and each
trace window with its reason and slowest ops."""

from __future__ import annotations

from typing import Any

from tpudiag.store import Store, longrun_queries


def build_pulse(store: Store, run: dict[str, Any], top: int = 20) -> dict[str, Any] | None:
    return longrun_queries.pulse_summary(store, run["id"])


def build_windows(store: Store, run: dict[str, Any], top: int = 20) -> list[dict[str, Any]] | None:
    rows = longrun_queries.windows(store, run["id"], top=min(top, longrun_queries.TOP_OPS))
    if not rows:
        return None
    out = []
    for w in rows:
        out.append(
            {
                "id": int(w["id"]),
                "reason": w["reason"],
                "first_step": w["first_step"],
                "last_step": w["last_step"],
                "start_s": w["start_s"],
                "end_s": w["end_s"],
                "trace_events": int(w["trace_events"]),
                "detail": w["detail"],
                "numerics": bool(w["numerics"]),
                "pruned": bool(w["pruned"]),
                "rank": int(w["rank"]),
                "top_ops": [
                    {"name": o["name"], "calls": int(o["calls"]), "self_us": round(float(o["self_us"]), 3)}
                    for o in w["top_ops"]
                ],
            }
        )
    return out


def render_pulse(section: dict[str, Any] | None) -> list[str]:
    if not section:
        return []
    lines = [
        "",
        "Timeline (pulse: every step)",
        f"  {section['steps']} steps; step time median {section['step_time_p50_s'] * 1e3:.2f} ms, "
        f"p99 {section['step_time_p99_s'] * 1e3:.2f} ms, longest {section['step_time_max_s'] * 1e3:.2f} ms; "
        f"between steps {section['gaps_s']:.2f} s; tpudiag's own time {section['tpudiag_s']:.3f} s",
    ]
    extra = []
    if section["recompiles"]:
        extra.append(f"{section['recompiles']} recompile(s)")
    if section["graph_breaks"]:
        extra.append(f"{section['graph_breaks']} graph break(s)")
    if section["nonfinite_steps"]:
        extra.append(f"{section['nonfinite_steps']} step(s) with a non-finite gradient")
    if extra:
        lines.append("  " + ", ".join(extra))
    slow = section["slow_steps"]
    if slow:
        shown = ", ".join(f"{s['step']} ({s['dur_s'] * 1e3:.1f} ms)" for s in slow[:10])
        lines.append(f"  slow steps (> 4x the median): {shown}" + (" ..." if len(slow) > 10 else ""))
    return lines


def render_windows(section: list[dict[str, Any]] | None) -> list[str]:
    if not section:
        return []
    lines = ["", "Trace windows"]
    for w in section:
        steps = f"steps {w['first_step']}-{w['last_step']}" if w["first_step"] is not None else "no steps"
        top = w["top_ops"][0]["name"] if w["top_ops"] else "-"
        state = " (pruned: --max-disk)" if w["pruned"] else ""
        lines.append(
            f"  #{w['id']:<3} {w['reason']:<12} {steps:<18} at {w['start_s']:.1f}-{w['end_s']:.1f} s  "
            f"{w['trace_events']} events, top op {top}{state}"
        )
        if w["detail"]:
            lines.append(f"       {w['detail']}")
    return lines
