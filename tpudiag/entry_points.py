"""Plugins found through entry points (collectors, exporters): tpudiag's own first, then other distributions'.

Kept free of heavy imports: the CLI reads the exporter names while building its parser, before tpudiag's threads
are told to leave SIGINT/SIGTERM to the script's thread (pyarrow, imported, would start threads of its own).
"""

from __future__ import annotations

import importlib.metadata

from tpudiag.errors import UsageError

DISTRIBUTION = "tpudiag"


def entry_point_specs(group: str) -> dict[str, str]:
    """Name -> "module:attr" of every entry point in ``group``: tpudiag's own first, then other distributions',
    which cannot replace a name already taken."""
    own: dict[str, str] = {}
    others: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=group):
        dist = getattr(ep, "dist", None)
        target = own if dist is not None and dist.name == DISTRIBUTION else others
        target.setdefault(ep.name, ep.value)
    if not own:
        raise UsageError(
            f"tpudiag's own {group} entry points are missing: install tpudiag (pip install -e .) so that its "
            "built-ins register"
        )
    for name, spec in others.items():
        own.setdefault(name, spec)
    return own
