"""The Slow ops page's XLA part: per-chip device time (compute / copy / collective, the async line apart), the
slowest HLO ops with their share of the chip's peak FLOPs and HBM bandwidth, and a treemap by HLO module.

The numbers are the report's ``hlo_ops`` section (``tpudiag.hlo_report``), so page and report agree."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import streamlit as st

from tpudiag.app.common import fmt_ns
from tpudiag.hlo_report import KINDS, build_section
from tpudiag.store import Store

TOP = 50


def chip_table(section: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "chip": d["device"],
            "type": d["device_type"] or "-",
            "busy s": round(d["busy_us"] / 1e6, 6),
            "span s": round(d["span_us"] / 1e6, 6),
            **{f"{k} s": round(d[f"{k}_us"] / 1e6, 6) for k in KINDS},
            "async line s": round(d["async_us"] / 1e6, 6),
        }
        for d in section["devices"]
    ]


def hlo_table(section: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "hlo op": o["name"],
            "module": o["module"] or "-",
            "kind": o["kind"],
            "category": o["category"] or "-",
            "calls": o["occurrences"],
            "self s (all chips)": round(o["self_us"] / 1e6, 6),
            "per chip s": round(o["per_chip_us"] / 1e6, 6),
            "FLOPs util %": None if o["flops_util"] is None else round(100 * o["flops_util"], 2),
            "HBM BW util %": None if o["hbm_bw_util"] is None else round(100 * o["hbm_bw_util"], 2),
        }
        for o in section["ops"]
    ]


def module_treemap(section: dict[str, Any]) -> go.Figure | None:
    """HLO module -> op boxes of device self time (ms, summed over chips)."""
    ops = [o for o in section["ops"] if o["self_us"] > 0]
    if not ops:
        return None
    modules: dict[str, float] = {}
    for o in ops:
        modules[o["module"] or "(no module)"] = modules.get(o["module"] or "(no module)", 0.0) + o["self_us"]
    ids = [f"m:{m}" for m in modules] + [f"o:{o['program_id']}:{o['name']}" for o in ops]
    fig = go.Figure(
        go.Treemap(
            ids=ids,
            labels=list(modules) + [o["name"] for o in ops],
            parents=[""] * len(modules) + [f"m:{o['module'] or '(no module)'}" for o in ops],
            values=[v / 1e3 for v in modules.values()] + [o["self_us"] / 1e3 for o in ops],
            branchvalues="total",
            hovertemplate="%{label}<br>%{value:.3f} ms<extra></extra>",
        )
    )
    fig.update_layout(height=420, margin={"l": 10, "r": 10, "t": 30, "b": 10}, title="HLO op self time by module")
    return fig


def section_of(s: Store, run: dict[str, Any]) -> dict[str, Any] | None:
    """The run's ``hlo_ops`` report section (None: no HLO ops).  Only TPU runs and imports can hold HLO ops, so a
    PyTorch CPU/CUDA capture (the common case, possibly millions of events) skips the scan."""
    if run.get("device_kind") != "tpu" and run.get("source") != "import":
        return None
    return build_section(s, run, top=TOP)


def render(section: dict[str, Any] | None) -> bool:
    """The XLA part of the page; False when the run has no HLO ops."""
    if section is None:
        return False
    st.subheader("XLA: per chip and per HLO op")
    chips = section["devices"]
    if len(chips) > 1:
        busy = [d["busy_us"] * 1e3 for d in chips]
        st.caption(
            f"{len(chips)} chips: op self time below is summed over them (as XProf's HLO op stats sum it); "
            f"each chip was busy {fmt_ns(min(busy))} to {fmt_ns(max(busy))}."
        )
    st.dataframe(chip_table(section), hide_index=True, key="xla_chips")
    fig = module_treemap(section)
    if fig is not None:
        st.plotly_chart(fig, key="xla_tree")
    st.dataframe(hlo_table(section), hide_index=True, key="xla_ops")
    return True
