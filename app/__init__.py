"""The Streamlit dashboard (installed as ``tpudiag.app``)."""
