"""Collector plugins: a tiny protocol, the built-ins, and third-party ones found through entry points.

Built-ins are named here as module paths and loaded exactly like third-party plugins (entry point group
``tpudiag.collectors``), so the core never imports a collector module directly.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tpudiag.clock import Clock, SystemClock
from tpudiag.errors import UsageError
from tpudiag.spool import Spool

ENTRY_POINT_GROUP = "tpudiag.collectors"

# name -> "module:attribute" of a factory returning a Collector.
BUILTIN_COLLECTORS: dict[str, str] = {
    "trace": "tpudiag.collectors.trace:TraceCollector",
    "compile": "tpudiag.collectors.compile:CompileCollector",
    "numerics": "tpudiag.collectors.numerics:NumericsCollector",
}


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


def _load(spec: str) -> Callable[[], Collector]:
    module_name, _, attr = spec.partition(":")
    module = importlib.import_module(module_name)
    factory: Callable[[], Collector] = getattr(module, attr)
    return factory


def available_factories() -> dict[str, str]:
    """Every known collector name -> its "module:attr" spec (built-ins first, then entry points)."""
    specs = dict(BUILTIN_COLLECTORS)
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        specs.setdefault(ep.name, ep.value)
    return specs


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
    return collectors
