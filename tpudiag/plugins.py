"""Collector plugins: a tiny protocol, and every collector found through entry points.

Built-ins are registered exactly like third-party plugins: tpudiag's own ``pyproject.toml`` lists them in the
``tpudiag.collectors`` entry-point group (exporters: ``tpudiag.exporters``), so the core never imports a collector
module directly and names none.  tpudiag's own entries come first; a third-party entry cannot take a built-in's name.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tpudiag.clock import Clock, SystemClock
from tpudiag.entry_points import entry_point_specs
from tpudiag.errors import UsageError
from tpudiag.spool import Spool

ENTRY_POINT_GROUP = "tpudiag.collectors"
DEFAULT_START_ORDER = 100  # after the built-ins (10-30)


@dataclass
class CaptureContext:
    """What a collector gets from the capture session."""

    run_id: str
    run_dir: Path
    spool: Spool
    options: dict[str, Any] = field(default_factory=dict)
    clock: Clock = field(default_factory=SystemClock)
    notes: list[str] = field(default_factory=list)
    # Extra key/values collectors want recorded in the run's metadata (e.g. the active precision).
    metadata: dict[str, Any] = field(default_factory=dict)

    def note(self, text: str) -> None:
        """Something the user should know about this capture (shown in the report)."""
        if text not in self.notes:
            self.notes.append(text)


@runtime_checkable
class Collector(Protocol):
    name: str
    # Optional ``start_order`` (int, default DEFAULT_START_ORDER): collectors start in ascending order and stop in
    # reverse, whatever order they are named or registered in.

    def is_available(self) -> bool:
        """Cheap check, called before the target runs; must not import heavy modules needlessly."""
        ...

    def prepare(self, ctx: CaptureContext) -> None:
        """Called before torch is imported (environment knobs that torch reads at import go here)."""
        ...

    def start(self, ctx: CaptureContext) -> None: ...

    def stop(self) -> None:
        """Stop collecting and write everything still held to ``ctx.spool``."""
        ...

    def flush(self) -> None:
        """Write what was collected so far to the spool (called periodically during long runs)."""
        ...

    # Optional ``finish(ctx)``: work ``stop`` left in ``ctx.run_dir`` for later, run after the script's exit status
    # is known, possibly in another process and on a fresh instance (tpudiag/deferred_store.py).  Only a capture
    # that sets ``ctx.options["defer_analysis"]`` before ``stop`` gets it; otherwise ``stop`` does everything.


def _load(spec: str) -> Callable[[], Collector]:
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    factory: Callable[[], Collector] = getattr(module, attr)
    return factory


def available_factories() -> dict[str, str]:
    """Every known collector name -> its "module:attr" spec (built-ins first, then third-party plugins)."""
    return entry_point_specs(ENTRY_POINT_GROUP)


def deferred_finishers(names: list[str]) -> list[tuple[str, Callable[[CaptureContext], None]]]:
    """The ``finish`` of each named collector that has one (names no longer installed are passed over)."""
    specs = available_factories()
    finishers: list[tuple[str, Callable[[CaptureContext], None]]] = []
    for name in names:
        if name in specs:
            work = getattr(_load(specs[name])(), "finish", None)
            if callable(work):
                finishers.append((name, work))
    return finishers


def load_collectors(names: list[str] | None) -> list[Collector]:
    """Instantiate the named collectors, or every available one when ``names`` is None."""
    specs = available_factories()
    if names is not None:
        unknown = [n for n in names if n not in specs]
        if unknown:
            raise UsageError(f"unknown collector {', '.join(unknown)} (available: {', '.join(sorted(specs))})")
    chosen = names if names is not None else list(specs)
    collectors: list[Collector] = []
    for name in chosen:
        collector = _load(specs[name])()
        if collector.is_available():
            collectors.append(collector)
        elif names is not None:
            raise UsageError(f"collector {name!r} is not available here")
    collectors.sort(key=lambda c: getattr(c, "start_order", DEFAULT_START_ORDER))
    return collectors
