"""The run report: one JSON object (``report --json``) and its text rendering.

Sections other issues add (numerics, compile) register a builder and a renderer in ``SECTIONS``; the report keys
stay stable: ``run``, ``slow_ops``, ``steps``, ``numerics``, ``compile``, ``memory``.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Callable
from typing import Any

from tpudiag.display import host_op_kind
from tpudiag.internal_errors import NOTE_PREFIX
from tpudiag.store import Store, hlo_queries, queries, step_queries, step_summary_queries

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
KIND_ORDER = {"compute": 0, "copy": 1, "collective": 2, "other": 3, "autograd": 4}

Builder = Callable[[Store, dict[str, Any]], Any]
Renderer = Callable[[Any], list[str]]

# name -> "module:builder_fn:renderer_fn"; sections are imported lazily and fail soft.
SECTIONS: dict[str, str] = {
    "compile": "tpudiag.compile_report:build_section:render_section",
    "numerics": "tpudiag.distributed.rank_numerics:build_section:render_section",  # every rank's, in a job
    "hlo_ops": "tpudiag.hlo_report:build_section:render_section",
    "distributed": "tpudiag.distributed.report_section:build_section:render_section",
    "pulse": "tpudiag.longrun.report_section:build_pulse:render_pulse",
    "windows": "tpudiag.longrun.report_section:build_windows:render_windows",
    "memory": "tpudiag.memory_report:build_section:render_section",
}


def run_summary(run: dict[str, Any]) -> dict[str, Any]:
    out = {k: run.get(k) for k in RUN_KEYS}
    out["device"] = run.get("device_kind")
    return out


def steps_section(store: Store, run_id: str, run: dict[str, Any] | None = None) -> dict[str, Any]:
    run = run or queries.resolve_run(store, run_id)
    # A capture measured its script's run time; an import has only the trace.
    script_s = run.get("duration_s") if run.get("source") != "import" else None
    tool_total = step_queries.tool_total_ns(store, run_id)
    # Aggregated in SQL: a merged distributed run holds every rank's steps, which never come to Python at once.
    summary, listed = step_summary_queries.summarize(
        store, run_id, script_s, step_queries.op_span_ns(store, run_id), bool(tool_total), tool_total or None,
        MAX_STEPS_LISTED,
    )  # fmt: skip
    summary["per_step"] = [
        {
            "step": s["step"],
            "dur_s": round(s["dur_ns"] / 1e9, 6),
            **({"tpudiag_s": round(s["tool_ns"] / 1e9, 6)} if tool_total else {}),
            "input_shapes": json.loads(s["input_shapes"]) if s["input_shapes"] else None,
        }
        for s in listed
    ]
    return summary


def _load_section(spec: str) -> tuple[Builder, Renderer]:
    module_name, build_name, render_name = spec.split(":")
    module = importlib.import_module(module_name)
    return getattr(module, build_name), getattr(module, render_name)


def build(store: Store, run: dict[str, Any], top: int = 20) -> dict[str, Any]:
    report: dict[str, Any] = {
        "run": run_summary(run),
        # tpudiag's own failures inside the script (caught; the script was not affected), or None.
        "internal_errors": next(
            (n.removeprefix(NOTE_PREFIX).strip() for n in run.get("notes") or [] if n.startswith(NOTE_PREFIX)), None
        ),
        "slow_ops": queries.slow_ops(store, run["id"], limit=top),
        "steps": steps_section(store, run["id"], run),
        "numerics": None,
        "compile": None,
        "hlo_ops": None,
        "memory": None,
    }
    for key, spec in SECTIONS.items():
        builder, _ = _load_section(spec)
        report[key] = builder(store, run)
    _add_op_kinds(store, run["id"], report["slow_ops"])
    return report


def _add_op_kinds(store: Store, run_id: str, ops: list[dict[str, Any]]) -> None:
    """Each slow op's ``kind``: compute / autograd / other on host; compute / copy / collective on device."""
    if not ops:
        return
    if ops[0].get("time_source") == "device":
        for o in ops:  # the device op that took most of its time tells (an all-reduce under "reduce_sum")
            o["kind"] = hlo_queries.op_kind(None, o.get("top_device_op") or o["name"])
        return
    hlo = {o["name"] for o in hlo_queries.hlo_ops(store, run_id, limit=None)} if ops else set()
    for o in ops:
        o["kind"] = host_op_kind(o["name"], "xla_host_op" if o["name"] in hlo else None)


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


def human_us(v: float) -> str:
    """Microseconds in the unit a reader takes in at a glance: ``1.23 s``, ``4.56 ms``, ``7.8 us``."""
    if v >= 1e6:
        return f"{v / 1e6:.2f} s"
    if v >= 1e3:
        return f"{v / 1e3:.2f} ms"
    return f"{v:.1f} us"


def human_s(v: float | None) -> str:
    """Seconds (None: unknown) in the same units as op times."""
    return "?" if v is None else human_us(v * 1e6)


_us = human_us


def _op_row(o: dict[str, Any]) -> list[str]:
    return [o["name"], o.get("kind") or "-", o["module"] or "-", str(o["calls"]), _us(o["self_us"]), _us(o["total_us"])]


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
        lines.append(f"  started {started}, {human_s(dur)} on {run['host']} ({device}); torch {run['torch_version']}")
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
        head = f"steps: {steps['count']} ({steps['kind']}); first {human_s(steps['first_s'])}"
        if steady is not None:
            head += f"; steady median {human_s(steady)}"
        lines.append(f"{head}; outside steps {human_s(steps['outside_steps_s'])}")
        if steps.get("tpudiag_in_steps_s"):
            bare = steps.get("steady_median_without_tpudiag_s")
            lines.append(
                f"  of which tpudiag's own (numerics checker): {human_s(steps['tpudiag_in_steps_s'])} inside steps"
                + (f", steady median without it {human_s(bare)}" if bare is not None else "")
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
        shown = ops
        if source == "host":
            lines.append(f"slowest ops by self time ({source} time), compute ops first, then the rest:")
            # Stable sort: within a kind the ranking by self time stays; autograd bookkeeping comes after the ops.
            shown = sorted(ops, key=lambda o: KIND_ORDER.get(o.get("kind") or "other", len(KIND_ORDER)))
        else:  # device time: every op is the device's work, ranked as it is
            lines.append(f"slowest ops by self time ({source} time):")
        lines += [
            "  " + line
            for line in table(
                ["op", "kind", "module", "calls", "self", "total"],
                [_op_row(o) for o in shown],
                right={3, 4, 5},
            )
        ]
    else:
        lines.append("slow ops: no op events in this run")
    for key, spec in SECTIONS.items():
        if report.get(key) is not None and key != "numerics":
            _, renderer = _load_section(spec)
            lines += ["", *renderer(report[key])]
    return "\n".join(lines) + "\n"
