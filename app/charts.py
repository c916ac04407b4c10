"""Plotly figures for the dashboard: pure functions from query rows to figures (no Streamlit, no store).

Every stored string goes through ``chart_text`` before plotly sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from tpudiag.app.text import chart_text, fmt_ns

PALETTE = (
    "#4c78a8",
    "#f58518",
    "#54a24b",
    "#e45756",
    "#72b7b2",
    "#eeca3b",
    "#b279a2",
    "#ff9da6",
    "#9d755d",
    "#bab0ac",
)
NO_MODULE = "(no module)"
ERROR_FLOOR = 1e-3  # errors below this (exact matches included) are drawn at it on the log axis
HOVER_ERROR = "seq %{x}: %{customdata[0]}<br>%{customdata[1]}<br>error %{y:.3g}<extra></extra>"


def _layout(fig: go.Figure, height: int = 360, **kw: Any) -> go.Figure:
    fig.update_layout(height=height, margin={"l": 10, "r": 10, "t": 30, "b": 10}, **kw)
    return fig


def op_label(row: dict[str, Any]) -> str:
    """ "op" / "op · module" / "module" depending on what the row was grouped by."""
    parts = [p for p in (row.get("name"), row.get("module")) if p is not None]
    if row.get("name") is None and row.get("module") is None:
        parts = [NO_MODULE]
    return " · ".join(str(p) for p in parts)


def top_ops_bar(rows: Sequence[dict[str, Any]], title: str) -> go.Figure:
    """Horizontal bars, slowest on top."""
    rows = list(rows)[::-1]
    labels = [chart_text(op_label(r)) for r in rows]
    fig = go.Figure(
        go.Bar(
            x=[r["self_ns"] / 1e6 for r in rows],
            y=labels,
            orientation="h",
            marker_color=PALETTE[0],
            customdata=[[r["calls"], fmt_ns(r["total_ns"])] for r in rows],
            hovertemplate="%{y}<br>self %{x:.3f} ms<br>calls %{customdata[0]}<br>total %{customdata[1]}<extra></extra>",
        )
    )
    fig.update_xaxes(title_text="self time (ms)")
    fig.update_yaxes(automargin=True)
    return _layout(fig, height=max(260, 22 * len(rows) + 80), title=title)


def module_tree(rows: Sequence[dict[str, Any]]) -> go.Figure | None:
    """Treemap of self time over the module hierarchy (``a.b.c`` paths): own time plus the children's.

    Intermediate paths that have no op of their own still appear, with zero own time.
    """
    own: dict[str, float] = {}
    for r in rows:
        key = r["module"] if r["module"] else NO_MODULE
        own[key] = own.get(key, 0.0) + float(r["self_ns"] or 0)
    if not own:
        return None
    nodes: dict[str, str] = {}  # id -> parent id
    for path in own:
        parts = path.split(".") if path != NO_MODULE else [path]
        for i in range(len(parts)):
            node = ".".join(parts[: i + 1])
            nodes.setdefault(node, ".".join(parts[:i]))
    ids = list(nodes)
    fig = go.Figure(
        go.Treemap(
            ids=[chart_text(i) for i in ids],
            labels=[chart_text(i.rsplit(".", 1)[-1]) for i in ids],
            parents=[chart_text(nodes[i]) for i in ids],
            values=[own.get(i, 0.0) / 1e6 for i in ids],
            branchvalues="remainder",
            hovertemplate="%{id}<br>%{value:.3f} ms own<extra></extra>",
            textinfo="label+value",
            texttemplate="%{label}<br>%{value:.2f} ms",
        )
    )
    return _layout(fig, height=420, title="Self time by module (own ms; boxes include children)")


def step_breakdown(steps: Sequence[dict[str, Any]], breakdown: Sequence[dict[str, Any]]) -> go.Figure | None:
    """Per step: stacked op self time of the top ops, with the step's wall time as a line."""
    if not steps and not breakdown:
        return None
    fig = go.Figure()
    names: list[str] = []
    for r in breakdown:
        if r["name"] not in names:
            names.append(r["name"])
    for i, name in enumerate(names):
        pts = [r for r in breakdown if r["name"] == name]
        fig.add_bar(
            x=[r["step"] for r in pts],
            y=[r["self_ns"] / 1e6 for r in pts],
            name=chart_text(name),
            marker_color=PALETTE[i % len(PALETTE)],
        )
    if steps:
        fig.add_scatter(
            x=[r["step"] for r in steps],
            y=[r["dur_ns"] / 1e6 for r in steps],
            name="step wall time",
            mode="lines+markers",
            line={"color": "#333", "width": 1.5},
        )
    fig.update_layout(barmode="stack", legend={"orientation": "h", "y": -0.25})
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="ms per step")
    return _layout(fig, height=380, title="Time per step: top ops' self time and the step's wall time")


def step_timeline(events: Sequence[dict[str, Any]]) -> go.Figure:
    """Gantt of one step: one row per thread and nesting depth, bars at their offset within the step."""
    rows = sorted({(e["process"], e["thread"], int(e["depth"] or 0)) for e in events})
    lane = {key: i for i, key in enumerate(rows)}
    cats = sorted({e["category"] for e in events})
    fig = go.Figure()
    for ci, cat in enumerate(cats):
        pts = [e for e in events if e["category"] == cat]
        fig.add_bar(
            base=[e["offset_ns"] / 1e6 for e in pts],
            x=[max(e["dur_ns"], 1) / 1e6 for e in pts],
            y=[lane[(e["process"], e["thread"], int(e["depth"] or 0))] for e in pts],
            orientation="h",
            name=chart_text(cat),
            marker_color=PALETTE[ci % len(PALETTE)],
            customdata=[[chart_text(e["name"]), chart_text(e["module"] or "-"), fmt_ns(e["self_ns"])] for e in pts],
            hovertemplate="%{customdata[0]}<br>module %{customdata[1]}<br>start +%{base:.3f} ms, "
            "%{x:.3f} ms (self %{customdata[2]})<extra></extra>",
        )
    fig.update_yaxes(
        tickvals=list(range(len(rows))),
        ticktext=[chart_text(f"{t} · d{d}") for _p, t, d in rows],
        autorange="reversed",
    )
    fig.update_xaxes(title_text="ms since step start")
    fig.update_layout(barmode="overlay", bargap=0.15)
    return _layout(fig, height=max(260, 26 * len(rows) + 120), title="Step timeline (longest events)")


def histogram(rows: Sequence[dict[str, Any]]) -> go.Figure:
    """Calls per log-spaced duration bin (bins are log10 ns, 10 per decade)."""
    fig = go.Figure(
        go.Bar(
            x=[fmt_ns(10 ** r["log10_ns"]) for r in rows],
            y=[r["calls"] for r in rows],
            marker_color=PALETTE[1],
            hovertemplate="≥ %{x}: %{y} calls<extra></extra>",
        )
    )
    fig.update_xaxes(title_text="self time per call (log bins)", type="category")
    fig.update_yaxes(title_text="calls")
    return _layout(fig, height=300, title="Time distribution")


def per_step_bar(rows: Sequence[dict[str, Any]], title: str) -> go.Figure:
    fig = go.Figure(go.Bar(x=[r["step"] for r in rows], y=[r["self_ns"] / 1e6 for r in rows], marker_color=PALETTE[2]))
    fig.update_xaxes(title_text="step")
    fig.update_yaxes(title_text="self ms")
    return _layout(fig, height=300, title=title)


def error_along_run(
    series: Sequence[dict[str, Any]], marked: Sequence[dict[str, Any]], first_seq: int | None
) -> go.Figure:
    """Normalised error of each checked op in execution order, log y; divergent ops and originators marked."""
    fig = go.Figure()
    fig.add_scattergl(
        x=[r["seq"] for r in series],
        y=[max(float(r["error"]), ERROR_FLOOR) for r in series],
        mode="markers",
        marker={"size": 4, "color": PALETTE[0]},
        name="op (max over outputs)",
        customdata=[[chart_text(r["op"]), chart_text(r["module"] or "-")] for r in series],
        hovertemplate="seq %{x}: %{customdata[0]}<br>%{customdata[1]}<br>error %{y:.3g}<extra></extra>",
    )
    for label, originators, symbol, color in (
        ("divergent", False, "circle-open", "#e45756"),
        ("originator", True, "x", "#b00020"),
    ):
        pts = [
            r
            for r in marked
            if r["error"] is not None
            and (bool(r["originator"]) if originators else r["failed"] and not r["originator"])
        ]
        if pts:
            fig.add_scatter(
                x=[r["seq"] for r in pts],
                y=[max(float(r["error"]), ERROR_FLOOR) for r in pts],
                mode="markers",
                marker={"size": 11, "symbol": symbol, "color": color, "line": {"width": 2, "color": color}},
                name=label,
                customdata=[[chart_text(r["op"]), chart_text(r["module"] or "-")] for r in pts],
                hovertemplate=HOVER_ERROR,
            )
    if first_seq is not None:
        fig.add_vline(x=first_seq, line={"color": "#b00020", "dash": "dot"}, annotation_text="first divergence")
    fig.update_yaxes(
        type="log", dtick=1, exponentformat="power", title_text="normalised error  max|Δ| / (eps · max|ref|)"
    )
    fig.update_xaxes(title_text="op sequence")
    fig.update_layout(legend={"orientation": "h", "y": -0.2})
    return _layout(fig, height=380, title="Error along the run")


def module_errors(rows: Sequence[dict[str, Any]]) -> go.Figure:
    rows = [r for r in rows if r["max_error"] is not None][:25][::-1]
    fig = go.Figure(
        go.Bar(
            x=[r["max_error"] for r in rows],
            y=[chart_text(r["module"]) for r in rows],
            orientation="h",
            marker_color=["#e45756" if r["divergent"] else PALETTE[0] for r in rows],
        )
    )
    fig.update_xaxes(type="log", title_text="max normalised error")
    fig.update_yaxes(automargin=True)
    return _layout(fig, height=max(260, 22 * len(rows) + 80), title="Worst error per module (red: divergent)")


def compile_timeline(rows: Sequence[dict[str, Any]], origin_ns: int | None) -> go.Figure:
    """Compile events over time (or in order when timestamps are missing), sized by duration."""
    kinds = sorted({r["kind"] for r in rows})
    use_time = origin_ns is not None and all(r["ts_ns"] is not None for r in rows)
    fig = go.Figure()
    for i, kind in enumerate(kinds):
        pts = [r for r in rows if r["kind"] == kind]
        fig.add_scatter(
            x=[(r["ts_ns"] - origin_ns) / 1e9 if use_time and origin_ns is not None else r["seq"] for r in pts],
            y=[chart_text(kind)] * len(pts),
            mode="markers",
            name=chart_text(kind),
            marker={
                "size": [8 + min(30.0, 4 * (r["duration_s"] or 0) ** 0.5) for r in pts],
                "color": PALETTE[i % len(PALETTE)],
                "opacity": 0.8,
            },
            customdata=[
                [
                    chart_text(r["function"] or "-"),
                    chart_text(r["reason"] or ""),
                    f"{r['duration_s']:.3f} s" if r["duration_s"] is not None else "-",
                ]
                for r in pts
            ],
            hovertemplate="%{customdata[0]}<br>%{customdata[2]}<br>%{customdata[1]}<extra></extra>",
        )
    fig.update_xaxes(title_text="seconds since first event" if use_time else "event order")
    fig.update_layout(showlegend=False)
    return _layout(fig, height=max(240, 40 * len(kinds) + 120), title="Compile timeline")


def cache_bars(rows: Sequence[dict[str, Any]]) -> go.Figure:
    fig = go.Figure()
    tiers = [chart_text(r["tier"]) for r in rows]
    fig.add_bar(y=tiers, x=[r["hits"] for r in rows], name="hits", orientation="h", marker_color=PALETTE[2])
    fig.add_bar(y=tiers, x=[r["misses"] for r in rows], name="misses", orientation="h", marker_color=PALETTE[3])
    fig.update_layout(barmode="stack")
    fig.update_yaxes(automargin=True)
    return _layout(fig, height=max(200, 40 * len(rows) + 100), title="Cache lookups by tier")


def delta_bars(rows: Sequence[dict[str, Any]]) -> go.Figure:
    """Per-op self-time change B − A (red: slower in B)."""
    rows = list(rows)[::-1]
    fig = go.Figure(
        go.Bar(
            x=[r["delta_ns"] / 1e6 for r in rows],
            y=[chart_text(r["name"]) for r in rows],
            orientation="h",
            marker_color=["#e45756" if r["delta_ns"] > 0 else "#54a24b" for r in rows],
            hovertemplate="%{y}: %{x:+.3f} ms<extra></extra>",
        )
    )
    fig.update_xaxes(title_text="self time B − A (ms)")
    fig.update_yaxes(automargin=True)
    return _layout(fig, height=max(260, 22 * len(rows) + 80), title="Op self-time change")


def run_durations(runs: Sequence[dict[str, Any]]) -> go.Figure:
    runs = [r for r in runs if r.get("duration_s") is not None][::-1]
    status_color = {"ok": PALETTE[2], "failed": PALETTE[3], "interrupted": PALETTE[5], "running": PALETTE[0]}
    fig = go.Figure(
        go.Bar(
            x=[chart_text(r["id"]) for r in runs],
            y=[r["duration_s"] for r in runs],
            marker_color=[status_color.get(r["status"], PALETTE[9]) for r in runs],
            customdata=[[chart_text(r["name"]), chart_text(r["status"])] for r in runs],
            hovertemplate="%{customdata[0]} (%{customdata[1]})<br>%{y:.2f} s<extra></extra>",
        )
    )
    fig.update_yaxes(title_text="run duration (s)")
    return _layout(fig, height=280, title="Run durations (oldest → newest)")
