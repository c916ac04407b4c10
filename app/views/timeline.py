"""Streamlit page script; the page itself is tpudiag.app.timeline."""

from tpudiag.app.timeline import main

main()
