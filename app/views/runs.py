"""Streamlit page script; the page itself is tpudiag.app.runs."""

from tpudiag.app.runs import main

main()
