"""Streamlit page script; the page itself is tpudiag.app.ranks."""

from tpudiag.app.ranks import main

main()
