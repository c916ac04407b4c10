"""Exporters: a stored run written in a format other tools open (TensorBoard/XProf, Perfetto, Parquet).

An exporter is one small object (``name``, ``description``, ``export(store, run, out_dir, options)``)
that returns the files it wrote.  Built-ins and third-party exporters alike register as "module:Class" in the
``tpudiag.exporters`` entry-point group (tpudiag's own in its ``pyproject.toml``) and are loaded lazily.

Files are written under a temporary name and renamed into place, so an interrupted export leaves whole files
or none, never a truncated one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tpudiag.entry_points import entry_point_specs
from tpudiag.errors import UsageError
from tpudiag.store import Store

ENTRY_POINT_GROUP = "tpudiag.exporters"


@dataclass(frozen=True)
class ExportOptions:
    gzip: bool = False
    include_original: bool = True  # tensorboard: also export the run's original .xplane.pb files
    extra: dict[str, Any] = field(default_factory=dict)


class Exporter(Protocol):
    name: str
    description: str

    def export(self, store: Store, run: dict[str, Any], out_dir: Path, options: ExportOptions) -> list[Path]: ...


def exporter_specs() -> dict[str, str]:
    """Exporter name -> "module:Class": tpudiag's own, then other distributions' (which cannot replace one)."""
    return entry_point_specs(ENTRY_POINT_GROUP)


def load_exporter(name: str) -> Exporter:
    specs = exporter_specs()
    spec = specs.get(name)
    if spec is None:
        raise UsageError(f"unknown export format {name!r} (choose from {', '.join(sorted(specs))})")
    module_name, _, attr = spec.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    exporter: Exporter = cls()
    return exporter


def safe_name(text: str) -> str:
    """A file-name-safe version of a run or host name."""
    out = "".join(c if c.isalnum() or c in "-_." else "_" for c in text).strip(".")
    return out or "run"
