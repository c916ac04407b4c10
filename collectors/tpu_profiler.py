"""TPU tracing in ``capture``: the XProf trace (an XSpace) recorded through TorchTPU's own profiler.

The trace collector calls into this module when TorchTPU is loaded and a TPU is in use; Kineto alone sees no TPU
work.  Two recording paths (DESIGN §4.1):

- torch >= 2.12 with ``torch.tpu.profiler.TpuProfilerConfig``: the native ``torch.profiler.profile`` with the
  ``PrivateUse1`` activity and that config (``run_dir``, ``worker_rank``);
- otherwise ``torch_tpu._internal.profiler.profile(activities=[CPU, TPU], on_trace_ready=xprof_trace_handler(dir,
  rank))``, which writes ``dir/plugins/profile/<YYYY_MM_DD_HH_MM_SS>/<host>[_<rank>].xplane.pb``.

Pending device work is synchronised (``torch.accelerator.synchronize()``) before the profiler stops, so it lands in
the trace.  The XSpace files stay in the run folder (exporters hand them to XProf/TensorBoard) and their events are
loaded with the XPlane reader (``tpudiag.traces.xplane``).

Without a TPU runtime nothing here may hang or abort: ``torch.tpu.is_available()`` raises, so it is never called;
``torch.accelerator.is_available()`` is, guarded; libtpu's metadata-server query (minutes without a metadata
server) is switched off with ``TPU_SKIP_MDS_QUERY=1`` before torch loads, unless the user set it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from tpudiag.plugins import CaptureContext

SKIP_MDS_ENV = "TPU_SKIP_MDS_QUERY"
XSPACE_GLOB = "*.xplane.pb"


def prepare_environment(env: dict[str, str] | None = None) -> None:
    """Before ``import torch``: keep libtpu from querying a metadata server that is not there."""
    target = os.environ if env is None else env
    target.setdefault(SKIP_MDS_ENV, "1")


def torch_tpu_loaded() -> bool:
    """TorchTPU is imported (``import torch`` auto-loads it when installed)."""
    return "torch_tpu" in sys.modules


def tpu_in_use() -> bool:
    """A TPU runtime is up and is torch's current accelerator.  Never raises, never starts libtpu's device search."""
    if not torch_tpu_loaded():
        return False
    try:
        import torch

        if not torch.accelerator.is_available():
            return False
        device = torch.accelerator.current_accelerator()
        return device is not None and device.type == "tpu"
    except Exception:
        return False


def native_config_available() -> bool:
    """torch >= 2.12 with TorchTPU's ``TpuProfilerConfig``: record through ``torch.profiler`` itself."""
    try:
        import torch

        major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        return (major, minor) >= (2, 12) and hasattr(getattr(torch, "tpu", None), "profiler")
    except Exception:
        return False


class TpuTraceSession:
    """TorchTPU profiler sessions writing XSpace files under ``out_dir``, beside the trace collector's Kineto one.

    Only one ``torch.profiler`` session may run in a process, so on the native path the TPU part rides on the
    collector's own session: ``profile_kwargs()`` gives the activities and ``experimental_config`` to add to its
    ``torch.profiler.profile(...)`` call, and ``start``/``stop`` only synchronise.  On the ``torch_tpu`` path
    ``start``/``stop`` run TorchTPU's own profiler, which coexists with a Kineto session (checked with torch-tpu
    0.2.0).  ``standalone=True`` makes the native path run its own ``torch.profiler`` session (no collector
    session around); ``device=False`` records the host activity only (what a machine without a TPU can do).
    """

    def __init__(
        self,
        out_dir: Path,
        rank: int = 0,
        device: bool = True,
        native: bool | None = None,
        standalone: bool = False,
    ) -> None:
        self.out_dir = out_dir
        self.rank = rank
        self.device = device
        self.native = native_config_available() if native is None else native
        self.standalone = standalone
        self._active: Any = None  # the own profiler object (native standalone) or entered context (torch_tpu)
        self._written: set[Path] = set()

    @property
    def path_kind(self) -> str:
        return "torch.profiler+TpuProfilerConfig" if self.native else "torch_tpu.profiler"

    def profile_kwargs(self) -> dict[str, Any]:
        """What to add to the collector's ``torch.profiler.profile`` call (empty on the ``torch_tpu`` path)."""
        if not self.native:
            return {}
        import torch
        from torch.profiler import ProfilerActivity

        self.out_dir.mkdir(parents=True, exist_ok=True)
        tpu: Any = torch.tpu  # type: ignore[attr-defined]  # added by TorchTPU at import
        config = tpu.profiler.TpuProfilerConfig(run_dir=str(self.out_dir), worker_rank=str(self.rank))
        return {
            "activities": [ProfilerActivity.PrivateUse1] if self.device else [],
            "experimental_config": config,
        }

    def start(self) -> None:
        if self._active is not None:
            raise RuntimeError("the TPU profiler session is already running")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.native:
            if self.standalone:
                from torch.profiler import ProfilerActivity, profile

                extra = self.profile_kwargs()
                prof = profile(
                    activities=[ProfilerActivity.CPU, *extra["activities"]],
                    experimental_config=extra["experimental_config"],
                )
                prof.start()
                self._active = prof
            return
        from torch_tpu._internal import profiler as tp

        activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.TPU] if self.device else [])
        cm = tp.profile(activities=activities, on_trace_ready=tp.xprof_trace_handler(str(self.out_dir), str(self.rank)))
        cm.__enter__()
        self._active = cm

    def stop(self) -> list[Path]:
        """Synchronise pending device work, stop (when this session runs a profiler), return the XSpace files."""
        if self.device:
            with contextlib.suppress(Exception):
                import torch

                torch.accelerator.synchronize()
        active, self._active = self._active, None
        if active is not None:
            if self.native:
                active.stop()
            else:
                active.__exit__(None, None, None)
        return self.xspaces()

    def xspaces(self) -> list[Path]:
        return sorted(self.out_dir.rglob(XSPACE_GLOB))

    def write(self, ctx: CaptureContext, first_event_id: int = 0) -> int:
        """Load the XSpaces not written yet into the run's spool; returns the number of events written."""
        from tpudiag.errors import TpudiagError
        from tpudiag.traces import kineto_tables, xplane

        events = first_event_id
        for path in self.xspaces():
            if path in self._written:
                continue
            self._written.add(path)
            try:
                tables = xplane.load(path, ctx.run_id, rank=self.rank, first_event_id=events)
            except TpudiagError as err:
                ctx.note(f"the TPU trace {path.name} could not be read ({err})")
                continue
            ctx.spool.write_table("trace_events", tables.events)
            ctx.spool.write_table("steps", kineto_tables.steps_table(tables.steps, ctx.run_id, rank=self.rank))
            events += tables.events.num_rows
        ctx.metadata["tpu_trace_files"] = [str(p) for p in sorted(self._written)]
        return events - first_event_id


def session_for(ctx: CaptureContext, rank: int = 0) -> TpuTraceSession | None:
    """A session for this capture when a TPU is in use; otherwise None, with a note when TorchTPU is loaded."""
    if tpu_in_use():
        rank = int(ctx.options.get("rank", rank))  # a rank of a distributed job: its own worker_rank / file name
        return TpuTraceSession(ctx.run_dir / "trace" / "tpu", rank=rank)
    if torch_tpu_loaded():
        ctx.note("TorchTPU is loaded but no TPU is in use: the TPU trace was skipped (host trace only)")
    return None
