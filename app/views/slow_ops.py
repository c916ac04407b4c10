"""Streamlit page script; the page itself is tpudiag.app.slow_ops."""

from tpudiag.app.slow_ops import main

main()
