"""Streamlit page script; the page itself is tpudiag.app.compilation."""

from tpudiag.app.compilation import main

main()
