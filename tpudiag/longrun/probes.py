"""Per-step probes: figures another collector adds to every pulse record.

A probe is a function of no arguments that returns a dict of figures (numbers, or None when the figure is unknown
at this step: never 0 for "unknown").  It runs on the training thread at the end of every step, so it must be
cheap (a few microseconds) and must not synchronise a device.  The memory collector registers one (current and
peak bytes); a plugin may register its own::

    from tpudiag.longrun import probes
    handle = probes.register("memory", lambda: {"allocated_bytes": ..., "peak_bytes": ...})
    ...
    handle.remove()

A probe that raises is dropped after recording the failure once (tpudiag.internal_errors); its figures read None.
A probe may also ask for a trigger window (``control.request("memory", ...)``) when its figures say so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from tpudiag import internal_errors

Figure = float | int | None
Probe = Callable[[], dict[str, Figure]]

_lock = threading.Lock()
_probes: dict[str, Probe] = {}


@dataclass(frozen=True)
class ProbeHandle:
    name: str

    def remove(self) -> None:
        with _lock:
            _probes.pop(self.name, None)


def register(name: str, probe: Probe) -> ProbeHandle:
    """Add ``probe`` under ``name`` (a second registration under the same name replaces the first)."""
    with _lock:
        _probes[name] = probe
    return ProbeHandle(name)


def registered() -> list[str]:
    return sorted(_probes)


def collect() -> dict[str, Figure] | None:
    """Every probe's figures for the step that just ended, prefixed ``name.``; None when no probe is registered."""
    if not _probes:
        return None
    out: dict[str, Figure] = {}
    for name, probe in list(_probes.items()):
        try:
            figures = probe()
        except Exception as err:
            internal_errors.current().record("pulse", f"probe {name}", err)
            with _lock:
                _probes.pop(name, None)
            continue
        for key, value in figures.items():
            out[f"{name}.{key}"] = value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
    return out
