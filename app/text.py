"""Text helpers the dashboard and the notebook display share (no Streamlit here: a notebook must not import it)."""

from __future__ import annotations

import html
import math
from typing import Any


def fmt_ns(ns: float | int | None) -> str:
    if ns is None or (isinstance(ns, float) and math.isnan(ns)):
        return "–"
    v = float(ns)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.2f} {unit}"
    return f"{v:.0f} ns"


def chart_text(value: Any) -> str:
    """A stored string made safe for plotly, which reads a few HTML tags (<a>, <b>, <br>) in its labels."""
    return html.escape("" if value is None else str(value), quote=True)
