"""Streamlit page script; the page itself is tpudiag.app.memory."""

from tpudiag.app.memory import main

main()
