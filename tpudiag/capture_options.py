"""What a capture is asked to do (``CaptureOptions``) and what it returns (``CaptureResult``): shared by the script
runner (``script_capture``), the distributed launcher and the CLI, so none of them imports another for its types."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tpudiag.plugins import CaptureContext, Collector


@dataclass
class CaptureOptions:
    db: Path
    name: str | None = None
    collect: list[str] | None = None  # None: every available collector
    # How often spooled parts are loaded into the store while the script runs.
    flush_interval_s: float = field(default_factory=lambda: float(os.environ.get("TPUDIAG_FLUSH_S", "10")))
    collector_options: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None  # launchers only: the job's run id, the same on every node (distributed/multinode.py)
    remote: str | None = None  # launchers only: upload the node's run folder there (tpudiag.remote)
    # Store the run before returning; otherwise a detached child stores it after the script's exit (deferred_store).
    wait: bool = field(default_factory=lambda: os.environ.get("TPUDIAG_WAIT", "") not in ("", "0"))


@dataclass
class CaptureResult:
    run_id: str
    exit_code: int
    status: str
    collectors: list[Collector]
    context: CaptureContext
    stored: bool  # False: a detached child is storing it (every reader waits for it)
    internal_errors: str | None = None  # the closing line about tpudiag's own failures, if there were any
    forked_child: bool = False  # this is a child the script forked, which ran on to the script's end: no run
