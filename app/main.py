"""The dashboard's entry script (``streamlit run``): page setup, the run picker, navigation.

``tpudiag dashboard`` starts it with ``TPUDIAG_DB`` set to the store.  Nothing is cached across reruns and no
connection is held: each page reads the store afresh, so runs captured meanwhile show up on the next
interaction.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from tpudiag.app.common import sidebar, store

HERE = Path(__file__).resolve().parent

st.set_page_config(page_title="tpudiag", page_icon="⏱", layout="wide")
pages = [
    st.Page(HERE / "views" / "runs.py", title="Runs", url_path="runs", default=True),
    st.Page(HERE / "views" / "slow_ops.py", title="Slow ops", url_path="slow-ops"),
    st.Page(HERE / "views" / "timeline.py", title="Timeline", url_path="timeline"),
    st.Page(HERE / "views" / "numerics.py", title="Numerics", url_path="numerics"),
    st.Page(HERE / "views" / "compilation.py", title="Compile", url_path="compile"),
    st.Page(HERE / "views" / "memory.py", title="Memory", url_path="memory"),
    st.Page(HERE / "views" / "compare.py", title="Compare", url_path="compare"),
    st.Page(HERE / "views" / "ranks.py", title="Ranks", url_path="ranks"),
]
page = st.navigation(pages)
st.sidebar.title("tpudiag")
sidebar(store())
page.run()
