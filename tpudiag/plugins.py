"""Collector plugins: a small protocol, and every collector found through entry points.

Built-ins are registered exactly like third-party plugins: tpudiag's own ``pyproject.toml`` lists them in the
``tpudiag.collectors`` entry-point group (exporters: ``tpudiag.exporters``), so the core never imports a collector
module directly and names none.  tpudiag's own entries come first; a third-party entry cannot take a built-in's name.

What a collector may implement, all stated on ``Collector`` below:

- required: ``name``, ``is_available``, ``prepare``, ``start``, ``flush``, ``stop``;
- ``start_order`` (int, default ``DEFAULT_START_ORDER``) and ``description`` (one line for ``--help``);
- ``tables``: the record types it writes besides the built-in ones (frozen dataclasses with ``TABLE`` and a
  ``run_id`` field; their Arrow schema comes from the fields, see ``tpudiag.model``).  Loading the collector
  registers them (``model.register_table``): the spool and rank shards accept them, the store creates each table
  from its first part, and the distributed merge loads it into the run like the built-in tables;
- ``finish(ctx, args)``: deferred work.  In ``stop``, a collector may call ``ctx.defer(self, args)`` (JSON
  ``args``): when the session's sink stores the run later (``tpudiag capture`` without ``--wait``), the job is
  written into ``run.json`` as a ``DeferredJob`` naming the collector's factory, and run after the script's exit in
  the detached child, on a fresh instance (``run_job``).  ``defer`` returns False when the sink stores now: the
  collector then does the work in ``stop``.  A job may run twice (a child killed mid-way): it must be idempotent.
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
from tpudiag.model import register_table
from tpudiag.spool import Spool

ENTRY_POINT_GROUP = "tpudiag.collectors"
DEFAULT_START_ORDER = 100  # after the built-ins (10-30)


@dataclass(frozen=True)
class DeferredJob:
    """A collector's work left for after the script's exit: ``factory()`` (a "module:attr" spec) builds a fresh
    collector whose ``finish(ctx, args)`` does it, in whichever process stores the run.  Serialised in run.json."""

    collector: str
    factory: str
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, collector: Any, args: dict[str, Any]) -> DeferredJob:
        kind = type(collector)
        return cls(str(collector.name), f"{kind.__module__}:{kind.__qualname__}", dict(args))

    def to_json(self) -> dict[str, Any]:
        return {"collector": self.collector, "factory": self.factory, "args": self.args}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeferredJob:
        return cls(str(data["collector"]), str(data["factory"]), dict(data.get("args") or {}))


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
    # Set by the session before collectors stop: the sink stores the run later, so ``defer`` is accepted.
    can_defer: bool = False
    jobs: list[DeferredJob] = field(default_factory=list)

    def note(self, text: str) -> None:
        """Something the user should know about this capture (shown in the report)."""
        if text not in self.notes:
            self.notes.append(text)

    def defer(self, collector: Any, args: dict[str, Any]) -> bool:
        """Leave ``collector.finish(ctx, args)`` for after the script's exit; False: not possible, do it now."""
        if not self.can_defer:
            return False
        self.jobs.append(DeferredJob.of(collector, args))
        return True


@runtime_checkable
class Collector(Protocol):
    """What the capture session calls.  Optional members (read with ``getattr``; see the module docstring):

    - ``start_order: int``: collectors start in ascending order and stop in reverse (default 100; built-ins 10-30);
    - ``description: str``: one line for ``tpudiag capture --help``;
    - ``tables: Sequence[type]``: record types of the tables it writes besides the built-ins;
    - ``finish(self, ctx: CaptureContext, args: dict) -> None``: the work of a ``DeferredJob`` it left with
      ``ctx.defer(self, args)`` in ``stop``.
    """

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
    """Every known collector name -> its "module:attr" spec (built-ins first, then third-party plugins)."""
    return entry_point_specs(ENTRY_POINT_GROUP)


def start_order(collector: Collector) -> int:
    return int(getattr(collector, "start_order", DEFAULT_START_ORDER))


def declared_tables(collector: Collector) -> list[type[Any]]:
    return list(getattr(collector, "tables", ()) or ())


def run_job(job: DeferredJob, ctx: CaptureContext) -> None:
    """Do a deferred job: a fresh collector from the job's factory, its tables registered, its ``finish``."""
    collector = _load(job.factory)()
    for cls in declared_tables(collector):
        register_table(cls)
    work = getattr(collector, "finish", None)
    if not callable(work):
        raise TypeError(f"{job.factory} has no finish(ctx, args) for its deferred job")
    work(ctx, job.args)


def check_names(names: list[str] | None) -> dict[str, str]:
    """Fail with one clear line when a name is no known collector; every known name -> its spec."""
    specs = available_factories()
    if names is not None:
        unknown = [n for n in names if n not in specs]
        if unknown:
            raise UsageError(f"unknown collector {', '.join(unknown)} (available: {', '.join(sorted(specs))})")
    return specs


def load_collectors(names: list[str] | None) -> list[Collector]:
    """Instantiate the named collectors, or every available one when ``names`` is None."""
    specs = check_names(names)
    chosen = names if names is not None else list(specs)
    collectors: list[Collector] = []
    for name in chosen:
        collector = _load(specs[name])()
        if collector.is_available():
            collectors.append(collector)
        elif names is not None:
            raise UsageError(f"collector {name!r} is not available here")
    for collector in collectors:
        for cls in declared_tables(collector):
            try:
                register_table(cls)
            except ValueError as err:
                raise UsageError(f"collector {collector.name!r} declares a bad table: {err}") from None
    collectors.sort(key=start_order)
    return collectors
