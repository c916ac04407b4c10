"""What every dashboard page shares: the store, the selected run, formatting, safe display of stored strings.

Safety rule for the whole app: a string that came from the store (run names, op names, module paths, file
paths, reasons) is shown through ``st.text``, ``st.code``, dataframes or ``chart_text`` (plotly), never
through Markdown or HTML.  Headers, captions and messages only carry text written here.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from typing import Any

import streamlit as st

from tpudiag.app.text import chart_text as chart_text  # re-exported: the pages import them from here
from tpudiag.app.text import fmt_ns as fmt_ns
from tpudiag.errors import TpudiagError
from tpudiag.store import DEFAULT_DB, Store
from tpudiag.store import dashboard_queries as q
from tpudiag.store_access import open_store

RUN_KEY = "run"  # session-state key of the selected run id (shared by every page)
# Readers wait at most this long for a capture's write transaction before the page says the store is busy.
LOCK_TIMEOUT_S = 20.0


def store() -> Store:
    """The store the dashboard serves (``TPUDIAG_DB``), opened per use: nothing is held between runs."""
    return open_store(None, lock_timeout_s=LOCK_TIMEOUT_S)


def db_option(s: Store) -> str:
    """``--db PATH`` for commands shown to the user, empty when the store is the default one."""
    return "" if s.path.name == DEFAULT_DB and s.path.parent == s.path.cwd() else f"--db {shlex.quote(str(s.path))} "


def store_version(s: Store) -> tuple[int, ...]:
    """Changes whenever anything writes the store (DuckDB file or WAL): the cache key of every query."""
    out: list[int] = []
    for path in (s.path, s.path.with_name(s.path.name + ".wal")):
        try:
            st_ = path.stat()
        except FileNotFoundError:
            out += [0, 0]
            continue
        out += [st_.st_mtime_ns, st_.st_size]
    return tuple(out)


@st.cache_data(max_entries=256, show_spinner=False)
def _cached(name: str, path: str, version: tuple[int, ...], args: tuple[Any, ...], kwargs: tuple[Any, ...]) -> Any:
    fn: Callable[..., Any] = getattr(q, name)
    return fn(open_store(path, lock_timeout_s=LOCK_TIMEOUT_S), *args, **dict(kwargs))


def load(name: str, s: Store, *args: Any, **kwargs: Any) -> Any:
    """``dashboard_queries.<name>(s, *args, **kwargs)``, cached until the store changes.

    A rerun caused by one widget (pick an op, open a step) then reuses every other query's result, while a
    capture that lands in the store changes the key, so new data shows on the next interaction.
    """
    return _cached(name, str(s.path), store_version(s), args, tuple(sorted(kwargs.items())))


# -- formatting ----------------------------------------------------------------------------------------------
def fmt_num(v: float | int | None, digits: int = 3) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, int) or (float(v).is_integer() and abs(v) < 1e15):
        return f"{int(v):,}"
    return f"{v:.{digits}g}"


def run_label(run: dict[str, Any]) -> str:
    """How a run appears in pickers (plain text: select boxes do not render Markdown)."""
    return f"{run['name']} · {run['id']} · {run['status']}"


# -- state ---------------------------------------------------------------------------------------------------
def selected_run_id() -> str | None:
    value = st.session_state.get(RUN_KEY)
    return str(value) if value else None


def sidebar(s: Store) -> list[dict[str, Any]]:
    """The store path and the run picker; returns the run choices (newest first), [] for an empty store."""
    st.sidebar.text(f"store: {s.path}")
    if not s.exists():
        return []
    try:
        choices: list[dict[str, Any]] = load("list_run_choices", s)
    except TpudiagError as err:
        st.sidebar.warning("The store cannot be read right now.")
        st.sidebar.text(str(err))
        return []
    if not choices:
        return []
    ids = [c["id"] for c in choices]
    labels = {c["id"]: run_label(c) for c in choices}
    wanted = st.query_params.get("run")
    if wanted in ids and RUN_KEY not in st.session_state:
        st.session_state[RUN_KEY] = wanted
    if st.session_state.get(RUN_KEY) not in ids:
        st.session_state[RUN_KEY] = ids[0]
    st.sidebar.selectbox("Run", ids, key=RUN_KEY, format_func=lambda rid: labels.get(rid, rid))
    st.query_params["run"] = st.session_state[RUN_KEY]
    st.sidebar.caption(f"{len(ids)} run(s); new runs appear on the next interaction or refresh.")
    return choices


def empty_store(s: Store) -> None:
    """The teaching empty state: what to run to get something to look at."""
    st.info("This store has no runs yet. Capture one, then refresh this page:")
    st.code(f"tpudiag capture {db_option(s)}your_script.py --your-args", language="bash")
    st.caption(
        "Each capture records a profiler trace and, with the numerics and compile collectors, per-op "
        "accuracy against a CPU float64 reference and compile/cache events."
    )


def guarded(render: Callable[[Store], None]) -> None:
    """Run a page; a store that cannot be read becomes one message on the page, never a traceback."""
    s = store()
    try:
        render(s)
    except TpudiagError as err:
        st.error("The store could not be read.")
        st.text(str(err))


def current_run(s: Store, choices: list[dict[str, Any]] | None = None) -> str | None:
    """The selected run, or None after showing the empty state."""
    rid = selected_run_id()
    if rid is None:
        if choices is None and s.exists():
            choices = load("list_run_choices", s)
        if not choices:
            empty_store(s)
            return None
        rid = str(choices[0]["id"])
        st.session_state[RUN_KEY] = rid
    return rid


def run_heading(title: str, run: dict[str, Any] | None) -> None:
    st.header(title)
    if run:
        st.text(run_label(run))


def not_captured(what: str, s: Store, collector: str, run: dict[str, Any] | None) -> None:
    """Say plainly that a run holds no data of one kind, and how to capture it."""
    st.info(
        f"No {what} in this run: it was captured without the `{collector}` collector (or that collector "
        "recorded nothing). Capture again with it:"
    )
    script = run.get("script") if run else None
    argv = " ".join(shlex.quote(a) for a in (run.get("argv") or [])) if run else ""
    target = shlex.quote(script) if script else "your_script.py"
    st.code(f"tpudiag capture {db_option(s)}--collect trace,{collector} {target} {argv}".rstrip(), language="bash")
