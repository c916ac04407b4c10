"""Ranks: a distributed run rank by rank, with the cross-rank findings (stragglers, mismatch, divergence).

It shows the report's ``distributed`` section (``tpudiag.distributed.report_section``), so the page and
``tpudiag report`` never disagree.  A single-process run says so and shows how to capture a job.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
import streamlit as st

from tpudiag.app.common import chart_text, current_run, guarded, run_heading
from tpudiag.distributed import rank_numerics, report_section
from tpudiag.store import Store, queries

RANK_COLUMNS = (
    "rank", "status", "host", "pid", "steps", "step_median_s", "step_max_s", "collectives", "collective_s",
    "numerics", "numerics_failures", "numerics_checked", "exit_code", "error",
)  # fmt: skip


def rank_rows(section: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per rank; a ``chip`` column (TorchTPU's rank -> global device id) only when some rank has one."""
    chips = any(r.get("chip") is not None for r in section["ranks"])
    columns = (*RANK_COLUMNS[:3], "chip", *RANK_COLUMNS[3:]) if chips else RANK_COLUMNS
    return [{k: report_section.numerics_cell(r) if k == "numerics" else r.get(k) for k in columns}
            for r in section["ranks"]]  # fmt: skip


def rank_numerics_text(s: Store, run: dict[str, Any]) -> str | None:
    """Which ranks' ops diverge from the oracle and which agree (the report's numerics section), or None."""
    section = rank_numerics.build_section(s, run)
    ranks = (section or {}).get("ranks")
    return str(ranks["text"]) if ranks else None


def straggler_rows(section: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {
            "straggler rank": s["rank"],
            "kind": s["kind"],
            "late at": f"{s['late_at']}/{s['collectives']}",
            "others waited s": s["others_waited_s"],
            "own wait s": s["wait_s"],
            "worst collective #": s["worst_seq"],
        }
        for s in section["stragglers"]
    ]


def wait_chart(section: dict[str, Any]) -> go.Figure:
    ranks = section["ranks"]
    fig = go.Figure(
        go.Bar(
            x=[chart_text(f"rank {r['rank']}") for r in ranks],
            y=[r["collective_s"] for r in ranks],
            marker_color=["#e45756" if r["rank"] in {s["rank"] for s in section["stragglers"]} else "#4c78a8"
                          for r in ranks],
        )
    )  # fmt: skip
    fig.update_layout(height=320, margin={"l": 10, "r": 10, "t": 30, "b": 10}, title="Time inside collectives (s)")
    return fig


def render(s: Store) -> None:
    rid = current_run(s)
    if rid is None:
        return
    run = queries.resolve_run(s, rid)
    run_heading("Ranks", run)
    section = report_section.build_section(s, run)
    if section is None:
        st.info("This run is a single process. Capture a distributed job to see its ranks:")
        st.code("tpudiag capture -m torch.distributed.run --nproc-per-node 4 train.py", language="bash")
        return
    m = st.columns(4)
    m[0].metric("World size", str(section["world_size"]))
    m[1].metric("Attempts", str(len(section["attempts"])))
    failure = section["first_failure"]
    m[2].metric("First failure", "–" if failure is None else f"rank {failure['rank']}")
    m[3].metric("Stragglers", str(len(section["stragglers"])))
    if failure is not None:
        st.error(f"Rank {failure['rank']} failed first: {failure.get('error') or 'no error message'}")
    st.dataframe(rank_rows(section), hide_index=True, key="rk_ranks")
    st.plotly_chart(wait_chart(section), key="rk_wait")
    st.subheader("Stragglers")
    if section["stragglers"]:
        st.caption("The rank that arrives last at a collective waits least there; the others wait for it.")
        st.dataframe(straggler_rows(section), hide_index=True, key="rk_stragglers")
    else:
        st.caption("No rank arrived clearly last at collectives.")
    st.subheader("Across ranks")
    mismatch, divergence, compiles = (
        section["collective_mismatch"], section["rank_divergence"], section["compile_divergence"]
    )  # fmt: skip
    st.text(f"Collective mismatch at collective #{mismatch['seq']}: {mismatch['text']}" if mismatch
            else "Collectives: every rank ran the same sequence.")  # fmt: skip
    st.text(f"Numerics: {divergence['text']}" if divergence else "Numerics: parameter and gradient fingerprints agree.")
    across = rank_numerics_text(s, run)
    if across:
        st.text(f"Divergent ops against the oracle: {across}")
    if compiles:
        for r in compiles["ranks"]:
            st.text(f"Compile divergence: rank {r['rank']} compiled {r['compile']}, recompiled {r['recompile']}")


def main() -> None:
    guarded(render)
