"""The run report: one JSON object (``report --json``) and its text rendering.

Sections other issues add (numerics, compile) register a builder and a renderer in ``SECTIONS``; the report keys
stay stable: ``run``, ``slow_ops``, ``steps``, ``numerics``, ``compile``.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from typing import Any

from tpudiag.analysis.step_summary import StepSpan, summarize_steps
from tpudiag.store import Store, queries

RUN_KEYS = (
    "id",
    "name",
    "status",
    "exit_code",
    "source",
    "script",
    "argv",
    "cwd",
    "started_at",
    "duration_s",
    "host",
    "python_version",
    "torch_version",
    "tpudiag_version",
    "device_kind",
    "device_name",
    "precision",
    "env",
    "git_commit",
    "collectors",
    "notes",
    "artifacts_dir",
)
MAX_STEPS_LISTED = 500

Builder = Callable[[Store, dict[str, Any]], Any]
Renderer = Callable[[Any], list[str]]

# name -> "module:builder_fn:renderer_fn"; sections are imported lazily and fail soft.
SECTIONS: dict[str, str] = {
    "compile": "tpudiag.compile_report:build_section:render_section",
    "numerics": "tpudiag.numerics_report:build_section:render_section",
    "distributed": "tpudiag.distributed.report_section:build_section:render_section",
}


def run_summary(run: dict[str, Any]) -> dict[str, Any]:
    out = {k: run.get(k) for k in RUN_KEYS}
    out["device"] = run.get("device_kind")
    return out


def steps_section(store: Store, run_id: str) -> dict[str, Any]:
    rows = queries.steps(store, run_id)
    spans = [StepSpan(r["step"], r["start_ns"], r["dur_ns"], r["kind"], r["input_shapes"]) for r in rows]
    summary = summarize_steps(spans, queries.trace_span_ns(store, run_id))
    summary["per_step"] = [
        {
            "step": s.step,
            "dur_s": round(s.dur_ns / 1e9, 6),
            "input_shapes": json.loads(s.input_shapes) if s.input_shapes else None,
        }
        for s in spans[:MAX_STEPS_LISTED]
    ]
    return summary


def _load_section(spec: str) -> tuple[Builder, Renderer]:
    module_name, build_name, render_name = spec.split(":")
    module = importlib.import_module(module_name)
    return getattr(module, build_name), getattr(module, render_name)


def build(store: Store, run: dict[str, Any], top: int = 20) -> dict[str, Any]:
    report: dict[str, Any] = {
        "run": run_summary(run),
        "slow_ops": queries.slow_ops(store, run["id"], limit=top),
        "steps": steps_section(store, run["id"]),
        "numerics": None,
        "compile": None,
    }
    for key, spec in SECTIONS.items():
        builder, _ = _load_section(spec)
        report[key] = builder(store, run)
    return report


# -- text ---------------------------------------------------------------------------------------------------------
def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    right = right or set()
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def fmt(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return [fmt(headers), fmt(["-" * w for w in widths]), *(fmt(r) for r in rows)]


def _us(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f} s"
    if v >= 1e3:
        return f"{v / 1e3:.2f} ms"
    return f"{v:.1f} us"


def render_text(report: dict[str, Any]) -> str:
    run = report["run"]
    lines: list[str] = []
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(run["started_at"] or 0))
    device = f"{run['device_kind']}: {run['device_name']}" if run["device_name"] else run["device_kind"] or "?"
    if run.get("source") == "import":
        lines.append(f"run {run['id']}  {run['name']!r}  [imported {started}]")
        lines.append(f"  from: {' '.join(run['argv'] or [])}")
        lines.append(f"  device: {device}")
    else:
        lines.append(f"run {run['id']}  {run['name']!r}  [{run['status']}, exit {run['exit_code']}]")
        lines.append(f"  script: {run['script']} {' '.join(run['argv'] or [])}".rstrip())
        dur = run["duration_s"]
        lines.append(
            f"  started {started}, {dur if dur is not None else '?'} s on {run['host']} ({device}); "
            f"torch {run['torch_version']}"
        )
    for note in run.get("notes") or []:
        lines.append(f"  note: {note}")
    for key, spec in SECTIONS.items():
        if report.get(key) is not None and key == "numerics":
            _, renderer = _load_section(spec)
            lines += ["", *renderer(report[key])]
    steps = report["steps"]
    lines.append("")
    if steps["count"]:
        steady = steps["steady_median_s"]
        lines.append(
            f"steps: {steps['count']} ({steps['kind']}); first {steps['first_s']:.4f} s; steady median "
            f"{steady:.4f} s; outside steps {steps['outside_steps_s']} s"
            if steady is not None
            else f"steps: {steps['count']} ({steps['kind']}); first {steps['first_s']:.4f} s; outside steps "
            f"{steps['outside_steps_s']} s"
        )
        shapes = {json.dumps(s["input_shapes"]) for s in steps["per_step"] if s["input_shapes"] is not None}
        if len(shapes) > 1:
            lines.append(
                f"  input shapes changed across steps: {len(shapes)} distinct ({', '.join(sorted(shapes)[:5])})"
            )
    else:
        lines.append("steps: no trace recorded")
    ops = report["slow_ops"]
    lines.append("")
    if ops:
        source = ops[0].get("time_source", "host")
        lines.append(f"slowest ops by self time ({source} time):")
        lines += [
            "  " + line
            for line in table(
                ["op", "module", "calls", "self", "total"],
                [[o["name"], o["module"] or "-", str(o["calls"]), _us(o["self_us"]), _us(o["total_us"])] for o in ops],
                right={2, 3, 4},
            )
        ]
    else:
        lines.append("slow ops: no op events in this run")
    for key, spec in SECTIONS.items():
        if report.get(key) is not None and key != "numerics":
            _, renderer = _load_section(spec)
            lines += ["", *renderer(report[key])]
    return "\n".join(lines) + "\n"
