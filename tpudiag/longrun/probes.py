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

A collector that takes its readings in its own step hook ahead of the pulse's (``collectors/step_points.py``
``READ``) publishes them instead: ``probes.publish(name, figures)`` puts them in the record of the step that is
ending, once; steps with nothing published carry no figures of that name.  The pulse then pays nothing on the steps
between readings (the memory collector reads every 0.5 s on fast steps).
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
pulling = _probes  # the registered probes (read by the pulse without a call)
published: dict[str, dict[str, Figure]] = {}  # name -> figures for the step now ending (``publish``)


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


def publish(name: str, figures: dict[str, Figure]) -> None:
    """Figures for the record of the step now ending (a later publish under the same name before it replaces
    them).  On the training thread."""
    published[name] = figures


def withdraw(name: str) -> None:
    """Figures published under ``name`` and not yet taken are dropped (a collector that stops)."""
    published.pop(name, None)


def collect() -> dict[str, Figure] | None:
    """Every probe's figures for the step that just ended, and what was published for it, prefixed ``name.``; None
    when no probe is registered and nothing was published.  (The pulse calls it only when ``pulling`` or
    ``published`` holds something: a step with neither pays no call.)"""
    if not _probes and not published:
        return None
    out: dict[str, Figure] = {}
    if published:
        for name, figures in list(published.items()):
            for key, value in figures.items():
                out[f"{name}.{key}"] = (
                    value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
                )
        published.clear()
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
