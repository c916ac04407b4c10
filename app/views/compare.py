"""Streamlit page script; the page itself is tpudiag.app.compare."""

from tpudiag.app.compare import main

main()
