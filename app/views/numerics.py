"""Streamlit page script; the page itself is tpudiag.app.numerics."""

from tpudiag.app.numerics import main

main()
