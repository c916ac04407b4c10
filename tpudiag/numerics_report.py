"""The report's ``numerics`` section: coverage, the first divergent op, every divergent op, the precision context.

``build_section`` returns None for runs without numerics data (the report key stays null); ``render_section``
turns the section into text that leads with the first divergence.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tpudiag.display import device_precision, short_source
from tpudiag.store import Store, numerics_queries

MAX_LISTED = 200
METRIC_KEYS = (
    "max_abs",
    "max_rel",
    "mean_abs",
    "rmse",
    "cosine",
    "max_ulp",
    "mean_ulp",
    "scaled_error",
    "ref_scaled_error",
    "propagated_error",
    "threshold",
    "emulated_error",
    "nan_device",
    "inf_device",
    "nan_oracle",
    "inf_oracle",
    "mismatch_rate",
    "numel",
)
SETTINGS_FILE = Path("numerics") / "settings.json"


def _entry(row: dict[str, Any]) -> dict[str, Any]:
    metrics = {k: row[k] for k in METRIC_KEYS if row.get(k) is not None}
    entry: dict[str, Any] = {
        "seq": row["seq"],
        "op": row["op"],
        "module": row["module"],
        "phase": row["phase"],
        "source": row["source_loc"],
        "role": row["role"],
        "dtype": row["dtype"],
        "verdict": row["verdict"],
        "metrics": metrics,
        "output_index": row["output_index"],
        "kind": row["kind"],
        "note": row["note"],
    }
    if row.get("region") and row["region"] != "eager_op":
        entry.update(region=row["region"], graph=row.get("graph_id"), node=row.get("fx_node"))
        entry["target"] = row.get("target")
        if row.get("ref_rmse") is not None:
            metrics["ref_rmse"] = row["ref_rmse"]
    if row.get("precision"):
        entry["precision"] = json.loads(row["precision"])
    if row.get("repro_path"):
        entry["repro"] = f"tpudiag repro {{run}} {row['seq']}"
    return entry


def _one_per_op(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op call: its originating output if any, else its most divergent one."""
    best: dict[int, dict[str, Any]] = {}
    for row in rows:
        seq = row["seq"]
        cur = best.get(seq)
        if cur is None or _rank(row) > _rank(cur):
            best[seq] = row
    return [best[s] for s in sorted(best)]


def _rank(row: dict[str, Any]) -> tuple[int, float]:
    order = {"originator": 3, "propagator": 1}.get(row["role"] or "", 0)
    if row["verdict"] in ("fail", "overflow"):
        order = max(order, 3)
    elif row["verdict"] == "expected_precision":
        order = max(order, 2)
    return order, float(row.get("scaled_error") or row.get("propagated_error") or 0.0)


def first_divergence(entries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The first op that is itself wrong (fail/overflow); failing that, the first expected-precision finding."""
    for wanted in (("fail", "overflow"), ("expected_precision",)):
        for e in entries:
            if e["verdict"] in wanted:
                return e
    return None


def build_section(store: Store, run: dict[str, Any]) -> dict[str, Any] | None:
    if "numerics" not in (run.get("collectors") or []) and not numerics_queries.has_numerics(store, run["id"]):
        return None
    coverage = numerics_queries.coverage(store, run["id"])
    counts = numerics_queries.count_divergent(store, run["id"])
    rows = _one_per_op(numerics_queries.divergent_outputs(store, run["id"]))
    entries = [_entry(r) for r in rows]
    for e in entries:
        e["source_short"] = short_source(e["source"], run.get("script"))
        if "repro" in e:
            e["repro"] = e["repro"].format(run=run["id"])
    settings: dict[str, Any] = {}
    if run.get("artifacts_dir"):
        path = Path(run["artifacts_dir"]) / SETTINGS_FILE
        if path.is_file():
            settings = json.loads(path.read_text())
    coverage["divergent"] = counts
    coverage["sampling"] = settings.get("sampling")
    coverage["compiled_frames"] = settings.get("compiled_frames", 0)
    if settings.get("compiled"):
        coverage["compiled_graphs"] = settings["compiled"]
    coverage["seconds_checking"] = settings.get("seconds_checking")
    coverage["script"] = {"status": run.get("status"), "exit_code": run.get("exit_code")}  # a crash cuts checks short
    if coverage["ops_seen"] == 0:
        coverage["warning"] = "no aten ops were seen: nothing was checked"
    elif coverage["ops_checked"] == 0:
        coverage["warning"] = "no op was checked: every op was skipped (see skipped)"
    precision = dict(run.get("precision") or {})
    precision.update(settings.get("precision") or {})
    return {
        "coverage": coverage,
        "first_divergence": first_divergence(entries),
        "divergent_ops": entries[:MAX_LISTED],
        "precision": device_precision(precision, run.get("device_kind")),
    }


def verdict_line(ops_checked: int, status: str | None, exit_code: int | None) -> tuple[str, str]:
    """(level, text) of the no-divergence verdict: ``ok`` only when ops were checked and the script finished."""
    stopped = status not in (None, "ok") or exit_code not in (None, 0)
    how = f"the script stopped ({status or 'failed'}, exit {exit_code if exit_code is not None else '?'})"
    if ops_checked == 0:
        return "warning", "nothing was checked: 0 op calls compared" + (f"; {how} before any check" if stopped else "")
    if stopped:
        return "warning", f"no divergent op among the {ops_checked} op calls checked before {how}"
    return "ok", f"no divergent op among {ops_checked} checked op calls"


# -- text -----------------------------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _describe(e: dict[str, Any]) -> str:
    source = e.get("source_short") or e["source"] or "source unknown"
    if e.get("rank") is not None:  # a distributed run: every rank's divergent ops (distributed.rank_numerics)
        return f"rank {e['rank']}: " + _describe({**e, "rank": None})
    if e.get("region") == "compiled_node":
        return (
            f"node {e.get('node')} ({e['op']}) of compiled graph {e.get('graph')} in {e['module'] or '(no module)'} "
            f"({e['phase']}), {source}"
        )
    return f"seq {e['seq']} {e['op']} in {e['module'] or '(no module)'} ({e['phase']}), {source}"


def render_section(section: dict[str, Any]) -> list[str]:
    cov = section["coverage"]
    first = section["first_divergence"]
    lines = ["numerics (each op re-run on a CPU float64 oracle from its own inputs):"]
    if first is None:
        script = cov.get("script") or {}
        level, text = verdict_line(cov["ops_checked"], script.get("status"), script.get("exit_code"))
        lines.append(f"  {'WARNING: ' if level != 'ok' else ''}{text}")
    else:
        m = first["metrics"]
        lines.append(f"  FIRST DIVERGENCE: {_describe(first)}")
        if first.get("region") in ("compiled_graph", "compiled_node"):
            lines.append(
                f"    verdict {first['verdict']} ({first['role'] or 'no role'}), {first['dtype']}: RMSE against the "
                f"float64 replay {_fmt(m.get('rmse'))} (allowed {_fmt(m.get('threshold'))}; eager at the same dtype "
                f"{_fmt(m.get('ref_rmse'))}), max abs {_fmt(m.get('max_abs'))}"
                + (f"; {first['note']}" if first.get("note") else "")
            )
        else:
            lines.append(
                f"    verdict {first['verdict']} ({first['role'] or 'no role'}), {first['dtype']}: scaled error "
                f"{_fmt(m.get('scaled_error'))} eps (allowed {_fmt(m.get('threshold'))}), max abs "
                f"{_fmt(m.get('max_abs'))}, max rel {_fmt(m.get('max_rel'))}"
                + (f"; {first['note']}" if first.get("note") else "")
            )
        if first.get("repro"):
            lines.append(f"    reproduce: {first['repro']}")
    if cov.get("warning"):
        lines.append(f"  WARNING: {cov['warning']}")
    skipped = ", ".join(f"{k} {v}" for k, v in cov["skipped"].items()) or "none"
    lines.append(
        f"  coverage: {cov['ops_checked']} of {cov['ops_seen']} op calls checked "
        f"({_fmt(cov['flops_checked'])} of {_fmt(cov['flops_seen'])} FLOPs); skipped: {skipped}"
    )
    if cov.get("outputs_skipped"):
        lines.append("  outputs not compared: " + ", ".join(f"{k} {v}" for k, v in cov["outputs_skipped"].items()))
    compiled = cov.get("compiled_graphs") or {}
    if compiled.get("graphs"):
        graph_cov = (cov.get("by_region") or {}).get("compiled_graph", {})
        skipped_g = ", ".join(f"{k} {v}" for k, v in (graph_cov.get("skipped") or {}).items()) or "none"
        lines.append(
            f"  torch.compile graphs (each replayed on a CPU float64 oracle): {compiled.get('graphs_checked', 0)} of "
            f"{compiled['graphs']} graphs checked, {compiled.get('graph_checks', 0)} of "
            f"{compiled.get('graph_calls', 0)} calls; {compiled.get('divergent_graphs', 0)} divergent forward, "
            f"{compiled.get('divergent_backward_graphs', 0)} divergent backward, "
            f"{compiled.get('localised', 0)} localised to a node; calls skipped: {skipped_g}"
        )
        for repro in compiled.get("repros") or []:
            lines.append(f"    reproduce: python {repro}/repro.py")
    elif cov.get("compiled_frames"):
        lines.append(f"  torch.compile: {cov['compiled_frames']} frame(s) compiled normally; fused kernels not checked")
    entries = section["divergent_ops"]
    originators = [e for e in entries if e["role"] == "originator"]
    expected = [e for e in entries if e["verdict"] == "expected_precision"]
    propagators = [e for e in entries if e["role"] == "propagator"]
    if originators:
        lines.append(f"  originators ({len(originators)}):")
        lines += [
            f"    {_describe(e)}: {e['verdict']}, scaled error {_fmt(e['metrics'].get('scaled_error'))}"
            for e in originators[:20]
        ]
    if expected:
        lines.append(
            f"  expected precision loss ({len(expected)}): "
            + ", ".join(f"seq {e['seq']} {e['op']}" for e in expected[:10])
        )
    if propagators:
        lines.append(
            f"  propagators: {cov['divergent'].get('propagator', len(propagators))} op calls carry the "
            "divergence onward (correct from their own inputs)"
        )
    return lines
