"""Plotly figures of the Memory page: pure functions from rows to figures (stored strings through ``chart_text``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import plotly.graph_objects as go

from tpudiag.app.charts import PALETTE, _layout
from tpudiag.app.common import chart_text

MIB = float(1 << 20)
STEP_SERIES = (
    ("peak_bytes", "peak"),
    ("allocated_bytes", "allocated"),
    ("reserved_bytes", "reserved"),
    ("device_used_bytes", "device used (libtpu)"),
    ("rss_bytes", "process RSS"),
)


def per_step_lines(steps: Sequence[dict[str, Any]]) -> go.Figure | None:
    """One line per figure a backend gave (MiB per step); figures nobody gave are left out, not drawn as 0."""
    fig = go.Figure()
    for i, (key, label) in enumerate(STEP_SERIES):
        points = [(s["step"], s[key] / MIB) for s in steps if s.get(key) is not None]
        if points:
            fig.add_trace(
                go.Scatter(
                    x=[p[0] for p in points], y=[p[1] for p in points], mode="lines+markers", name=label,
                    line={"color": PALETTE[i % len(PALETTE)]},
                )
            )  # fmt: skip
    if not fig.data:
        return None
    return _layout(fig, title="Memory per step (MiB)", xaxis_title="step", yaxis_title="MiB")


def window_line(points: Sequence[dict[str, Any]]) -> go.Figure | None:
    """Live bytes over one trace window, per device (ms from the window's first point)."""
    if not points:
        return None
    t0 = min(int(p["ts_ns"]) for p in points)
    fig = go.Figure()
    for i, device in enumerate(sorted({str(p["device"]) for p in points})):
        rows = [p for p in points if str(p["device"]) == device]
        fig.add_trace(
            go.Scatter(
                x=[(int(p["ts_ns"]) - t0) / 1e6 for p in rows], y=[p["allocated_bytes"] / MIB for p in rows],
                mode="lines", name=chart_text(device), line={"shape": "hv", "color": PALETTE[i % len(PALETTE)]},
            )
        )  # fmt: skip
    return _layout(fig, title="Live bytes in the window (MiB)", xaxis_title="ms", yaxis_title="MiB")


def module_treemap(rows: Sequence[dict[str, Any]]) -> go.Figure | None:
    """Bytes live at the peak over the module hierarchy (``a.b.c`` paths; boxes include their children)."""
    own: dict[str, float] = {}
    for r in rows:
        own[str(r["module"])] = own.get(str(r["module"]), 0.0) + float(r["bytes"])
    if not own:
        return None
    nodes: dict[str, str] = {}
    for path in own:
        parts = path.split(".") if not path.startswith("(") else [path]
        for i in range(len(parts)):
            nodes.setdefault(".".join(parts[: i + 1]), ".".join(parts[:i]))
    ids = list(nodes)
    fig = go.Figure(
        go.Treemap(
            ids=[chart_text(i) for i in ids],
            labels=[chart_text(i.rsplit(".", 1)[-1]) for i in ids],
            parents=[chart_text(nodes[i]) for i in ids],
            values=[own.get(i, 0.0) / MIB for i in ids],
            branchvalues="remainder",
            hovertemplate="%{id}<br>%{value:.2f} MiB own<extra></extra>",
            texttemplate="%{label}<br>%{value:.2f} MiB",
        )
    )
    return _layout(fig, height=420, title="Live at the peak, by module (MiB; boxes include children)")
