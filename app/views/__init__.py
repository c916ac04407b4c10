"""Page scripts that st.navigation runs; each calls its page module."""
