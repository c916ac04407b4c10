"""A finished run as HTML for a notebook (``CapturedRun._repr_html_``; Jupyter and marimo).

Built from the dict of ``tpudiag report --json``: the headline, the slowest ops (table and the dashboard's bar
chart, ``app/charts.py``), the first divergence with its module and source line, and the compile summary.  Every
stored string is escaped.  The chart carries plotly.js inline (no network needed to view it); the other sections
are plain HTML.
"""

from __future__ import annotations

import html
from typing import Any

from tpudiag.compile_report import render_section as compile_lines
from tpudiag.report import human_s

TOP_OPS = 10


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def headline(report: dict[str, Any]) -> str:
    run = report["run"]
    device = f"{run.get('device_kind') or '?'}" + (f": {run['device_name']}" if run.get("device_name") else "")
    return (
        f"<b>tpudiag run <code>{_e(run['id'])}</code></b> {_e(run.get('name'))} · {_e(run.get('status'))}, "
        f"exit {_e(run.get('exit_code'))} · {_e(human_s(run.get('duration_s')))} on {_e(device)}"
    )


def _notes(report: dict[str, Any]) -> str:
    notes = report["run"].get("notes") or []
    return "".join(f"<div class='tpudiag-note'>note: {_e(n)}</div>" for n in notes)


def slow_ops_table(ops: list[dict[str, Any]]) -> str:
    if not ops:
        return "<p>slow ops: no op events in this run</p>"
    time_source = ops[0].get("time_source", "host")
    rows = "".join(
        f"<tr><td>{_e(o['name'])}</td><td>{_e(o.get('module'))}</td><td>{_e(o.get('calls'))}</td>"
        f"<td>{float(o.get('self_us') or 0):.1f}</td><td>{float(o.get('total_us') or 0):.1f}</td></tr>"
        for o in ops[:TOP_OPS]
    )
    return (
        f"<h4>slowest ops by self time ({_e(time_source)} time)</h4>"
        "<table class='tpudiag-ops'><tr><th>op</th><th>module</th><th>calls</th><th>self µs</th><th>total µs</th>"
        f"</tr>{rows}</table>"
    )


def slow_ops_chart(ops: list[dict[str, Any]]) -> str:
    """The dashboard's bar chart of the slowest ops, as an HTML fragment (empty when plotly cannot draw it)."""
    if not ops:
        return ""
    from tpudiag.app.charts import top_ops_bar

    rows = [
        {
            "name": o["name"],
            "module": o.get("module"),
            "calls": o.get("calls"),
            "self_ns": float(o.get("self_us") or 0) * 1e3,
            "total_ns": float(o.get("total_us") or 0) * 1e3,
        }
        for o in ops[:TOP_OPS]
    ]
    fig = top_ops_bar(rows, "slowest ops (self time)")
    fragment: str = fig.to_html(full_html=False, include_plotlyjs=True, default_width="100%")
    return f"<div class='tpudiag-chart'>{fragment}</div>"


def divergence(section: dict[str, Any] | None) -> str:
    if section is None:
        return ""
    first = section.get("first_divergence")
    if first is None:
        checked = (section.get("coverage") or {}).get("ops_checked", 0)
        return f"<h4>numerics</h4><p>no divergent op ({_e(checked)} op call(s) checked against the CPU oracle)</p>"
    metrics = first.get("metrics") or {}
    error = metrics.get("scaled_error")
    return (
        "<h4>numerics: first divergence</h4>"
        f"<p><b>{_e(first.get('op'))}</b> in module <code>{_e(first.get('module'))}</code> at "
        f"<code>{_e(first.get('source_short') or first.get('source'))}</code>: {_e(first.get('verdict'))}"
        + (f", scaled error {float(error):.3g}" if error is not None else "")
        + (f" (<code>{_e(first['repro'])}</code>)" if first.get("repro") else "")
        + "</p>"
    )


def compile_summary(section: dict[str, Any] | None) -> str:
    if section is None:
        return ""
    lines = compile_lines(section)
    return "<h4>compile</h4><pre>" + _e("\n".join(lines)) + "</pre>"


def run_html(report: dict[str, Any]) -> str:
    ops = report.get("slow_ops") or []
    parts = [
        f"<div class='tpudiag-run'><p>{headline(report)}</p>",
        _notes(report),
        divergence(report.get("numerics")),
        slow_ops_table(ops),
        slow_ops_chart(ops),
        compile_summary(report.get("compile")),
        "</div>",
    ]
    return "".join(parts)
