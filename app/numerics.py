"""Numerics: the first divergent op up front, error along the run, the per-module roll-up, one op in detail
with all its metrics and the command that reproduces it."""

from __future__ import annotations

import json
import shlex
from typing import Any

import streamlit as st

from tpudiag.app import charts
from tpudiag.app.common import current_run, db_option, fmt_num, guarded, load, not_captured, run_heading
from tpudiag.display import device_precision, short_source
from tpudiag.numerics_report import verdict_line
from tpudiag.store import Store, queries

ALL = "(all)"
METRIC_COLUMNS = (
    "output_index",
    "verdict",
    "role",
    "dtype",
    "numel",
    "scaled_error",
    "ref_scaled_error",
    "propagated_error",
    "threshold",
    "max_abs",
    "max_rel",
    "mean_abs",
    "rmse",
    "cosine",
    "max_ulp",
    "mean_ulp",
    "nan_device",
    "inf_device",
    "nan_oracle",
    "inf_oracle",
    "mismatch_rate",
    "note",
)


def repro_command(s: Store, run_id: str, seq: int) -> str:
    return f"tpudiag repro {db_option(s)}{shlex.quote(run_id)} {seq}"


def precision_text(run: dict[str, Any]) -> str:
    """The run's recorded precision settings as one line, or a plain statement that none were recorded."""
    prec = device_precision(run.get("precision") or {}, run.get("device_kind"))
    if not prec:
        return "not recorded"
    return ", ".join(f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in sorted(prec.items()))


def first_divergence_fields(first: dict[str, Any], run: dict[str, Any]) -> list[dict[str, str]]:
    """Field/value rows of the first divergence card (values as text)."""
    fields = [
        ("op", first.get("op") or "(op row not recorded)"),
        ("seq", fmt_num(first.get("seq"))),
        ("module", first.get("module") or "-"),
        ("phase", first.get("phase") or "-"),
        ("source", short_source(first.get("source_loc"), run.get("script")) or "-"),
        ("verdict", first.get("verdict") or "-"),
        ("role", first.get("role") or "-"),
        ("dtype", first.get("dtype") or "-"),
        ("normalised error", fmt_num(first.get("scaled_error"))),
        ("max abs error", fmt_num(first.get("max_abs"))),
        ("precision", precision_text(run)),
    ]
    if first.get("region") and first["region"] != "eager_op":
        # A compiled region (issue 12): which graph, and which FX node of it.
        where = f"{first['region']} {first.get('graph_id') or '?'}"
        fields.insert(1, ("region", where + (f", node {first['fx_node']}" if first.get("fx_node") else "")))
    return [{"field": k, "value": str(v)} for k, v in fields]


def first_divergence_card(fields: dict[str, str]) -> str:
    """The first divergence as aligned plain-text lines (shown in a code block: full text, never Markdown)."""
    return "\n".join(
        [
            f"op      {fields['op']}   ({fields['phase']}, seq {fields['seq']})",
            *([f"region  {fields['region']}"] if "region" in fields else []),
            f"module  {fields['module']}",
            f"source  {fields['source']}",
            f"dtype   {fields['dtype']} · max abs error {fields['max abs error']}",
            f"prec.   {fields['precision']}",
        ]
    )


def render(s: Store) -> None:
    rid = current_run(s)
    if rid is None:
        return
    run = queries.resolve_run(s, rid)
    run_heading("Numerics", run)
    view = load("load_numerics", s, rid)
    cov = view.coverage
    if not cov.get("ops_seen") and not view.verdicts:
        not_captured("numerics (per-op comparison against CPU float64)", s, "numerics", run)
        return
    m = st.columns(5)
    m[0].metric("Ops seen", fmt_num(cov["ops_seen"]))
    m[1].metric("Ops checked", fmt_num(cov["ops_checked"]))
    m[2].metric("Ops skipped", fmt_num(cov["ops_skipped"]))
    m[3].metric(
        "Divergent ops",
        fmt_num(
            len(
                {
                    r["seq"]
                    for r in view.divergent
                    if "fail" in (r["verdicts"] or "") or "overflow" in (r["verdicts"] or "")
                }
            )
        ),
    )
    m[4].metric("Originators", fmt_num(sum(1 for r in view.divergent if r["originator"])))
    if cov["ops_seen"] and not cov["ops_checked"]:
        st.warning("No op was checked in this run: every op was skipped (reasons below).")

    first = view.first_divergence
    if first:
        st.error("First divergence: the earliest op whose output differs from the CPU float64 reference.")
        fields = {f["field"]: f["value"] for f in first_divergence_fields(first, run)}
        card, *badges = st.columns([3.2, 1, 1.2, 1.2])
        card.code(first_divergence_card(fields), language=None)
        badges[0].metric("Verdict", fields["verdict"])
        badges[1].metric("Role", fields["role"])
        badges[2].metric("Normalised error", fields["normalised error"])
    else:
        level, text = verdict_line(int(cov.get("ops_checked") or 0), run.get("status"), run.get("exit_code"))
        if level == "ok":
            st.success("No divergent op: every checked output matched the CPU float64 reference within tolerance.")
        else:
            st.warning(text[0].upper() + text[1:] + ".")

    if view.series:
        fig = charts.error_along_run(view.series, view.marked, first["seq"] if first else None)
        st.plotly_chart(fig, key="nm_series")
        if view.series_bucketed:
            st.caption("Long run: each point is the worst op of a bucket of consecutive ops.")
        if any(r["error"] is not None and r["error"] < charts.ERROR_FLOOR for r in view.series):
            st.caption("Outputs equal to the reference (error 0, or below 10⁻³) are drawn on the 10⁻³ line.")
    else:
        st.caption("No normalised error was recorded for any output.")

    left, right = st.columns([1, 1])
    with left:
        st.subheader("By module")
        st.dataframe(view.modules, hide_index=True, key="nm_modules")
    with right:
        if any(r["max_error"] is not None for r in view.modules):
            st.plotly_chart(charts.module_errors(view.modules), key="nm_module_chart")
    if view.skipped:
        st.caption("Skipped ops by reason")
        st.dataframe(view.skipped, hide_index=True, key="nm_skipped")

    st.subheader("Op detail")
    candidates = view.divergent or [{"seq": r["seq"], "op": r["op"], "module": r["module"]} for r in view.series[:1]]
    if not candidates:
        st.caption("No op to show.")
        return
    labels = {r["seq"]: f"{r['seq']} · {r['op'] or '?'} · {r['module'] or '-'}" for r in candidates}
    seqs = list(labels)
    default = seqs.index(first["seq"]) if first and first["seq"] in seqs else 0
    seq = st.selectbox(
        "Op (divergent ops and originators, in execution order)",
        seqs,
        index=default,
        format_func=labels.__getitem__,
        key="nm_op",
    )
    _op_detail(s, rid, int(seq))


def _op_detail(s: Store, rid: str, seq: int) -> None:
    op, diffs = load("load_op_diffs", s, rid, seq)
    if op:
        info = {
            k: op.get(k)
            for k in (
                "seq",
                "op",
                "overload",
                "module",
                "phase",
                "source_loc",
                "step",
                "dtypes",
                "shapes",
                "device",
                "checked",
                "skip_reason",
                "flops",
            )
        }
        st.dataframe(
            [{"field": k, "value": "" if v is None else str(v)} for k, v in info.items()],
            hide_index=True,
            key="nm_op_info",
        )
    st.dataframe([{k: d.get(k) for k in METRIC_COLUMNS} for d in diffs], hide_index=True, key="nm_op_metrics")
    st.caption("Reproduce this op alone, on the device and on CPU:")
    st.code(repro_command(s, rid, seq), language="bash")


def main() -> None:
    guarded(render)
