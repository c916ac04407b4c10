"""Per-step memory figures from whatever the backend answers, each with its source; unknown is None, never 0.

``MemorySampler.sample()`` returns one plain dict (the long-run pulse can call it as it is):

- ``allocated_bytes`` / ``reserved_bytes`` / ``peak_bytes``: the device allocator (``torch.cuda.*`` on CUDA,
  ``torch.accelerator.memory_*`` on another accelerator that answers them);
- ``device_used_bytes`` / ``limit_bytes``: libtpu's monitoring SDK (``hbm_capacity_usage`` / ``hbm_capacity_total``,
  chip 0 of this process) when libtpu is loaded, or the CUDA device's total memory;
- ``rss_bytes``: this process's resident set (``/proc/self/statm``), on every backend;
- ``sources``: figure -> where it came from.

Peak counters are read, never reset: ``torch.cuda.reset_peak_memory_stats`` would change what the script itself
reads.  So the device ``peak_bytes`` is the peak since the process started (or since the script's own reset); the
peak of each step comes from the profiler's memory events when a trace window records them.  Nothing here
synchronises a device: allocator counters are host-side.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from typing import Any

from tpudiag.proc_field import ProcField

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
LIBTPU_EVERY_S = 1.0  # libtpu's metrics are read at most this often (their cost is not known on every chip)


class _Statm:
    """``/proc/self/statm``'s resident pages, kept open (``tpudiag.proc_field``), in bytes."""

    def __init__(self) -> None:
        self._pages = ProcField("/proc/self/statm", 1)

    def rss_bytes(self) -> int | None:
        pages = self._pages.read()
        return None if pages is None else pages * _PAGE

    def close(self) -> None:
        self._pages.close()


def _rlimit_as() -> int | None:
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def _first_int(values: Any) -> int | None:
    """libtpu's ``Metric.data()``: one value per chip (numbers or strings); chip 0's, as bytes."""
    try:
        seq = list(values)
        return int(float(seq[0])) if seq else None
    except (TypeError, ValueError):
        return None


class MemorySampler:
    """Chooses the backend once (first sample), then reads its counters on each call."""

    def __init__(self) -> None:
        self.backend: str | None = None  # "cuda" | "accelerator" | "tpu" | "cpu"
        self.device: str | None = None
        self._torch: Any = None
        self._libtpu: Any = None
        self._libtpu_at = 0.0
        self._libtpu_last: tuple[int | None, int | None] = (None, None)
        self._cuda_total: int | None = None
        self._statm = _Statm()

    def close(self) -> None:
        self._statm.close()

    def _choose(self) -> None:
        torch = sys.modules.get("torch")
        self._torch = torch
        self.backend, self.device = "cpu", "cpu"
        if torch is None:
            return
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            index = torch.cuda.current_device()
            self.backend, self.device = "cuda", f"cuda:{index}"
            try:
                self._cuda_total = int(torch.cuda.get_device_properties(index).total_memory)
            except Exception:
                self._cuda_total = None
            return
        if "torch_tpu" in sys.modules:
            self.backend, self.device = "tpu", "tpu:0"
            try:
                from libtpu.sdk import tpumonitoring  # type: ignore[import-not-found]

                self._libtpu = tpumonitoring
            except Exception:
                self._libtpu = None
            return
        try:
            acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        except Exception:
            acc = None
        if acc is not None and acc.type != "cpu":
            self.backend, self.device = "accelerator", f"{acc.type}:{torch.accelerator.current_device_index()}"

    def sample(self) -> dict[str, Any]:
        if self.backend is None:
            self._choose()
        figures: dict[str, Any] = {
            "device": self.device,
            "allocated_bytes": None,
            "reserved_bytes": None,
            "peak_bytes": None,
            "device_used_bytes": None,
            "limit_bytes": None,
            "rss_bytes": self._statm.rss_bytes(),
        }
        sources: dict[str, str] = {"rss_bytes": "/proc/self/statm"} if figures["rss_bytes"] is not None else {}
        if self.backend == "cuda":
            self._cuda(figures, sources)
        elif self.backend in ("accelerator", "tpu"):
            self._accelerator(figures, sources)
            if self._libtpu is not None:
                self._tpu_monitoring(figures, sources)
        else:
            limit = _rlimit_as()
            if limit is not None:
                figures["limit_bytes"] = limit
                sources["limit_bytes"] = "RLIMIT_AS"
        figures["sources"] = sources
        return figures

    def _cuda(self, figures: dict[str, Any], sources: dict[str, str]) -> None:
        cuda = self._torch.cuda
        for key, fn in (
            ("allocated_bytes", "memory_allocated"),
            ("reserved_bytes", "memory_reserved"),
            ("peak_bytes", "max_memory_allocated"),
        ):
            try:
                figures[key] = int(getattr(cuda, fn)())
                sources[key] = f"torch.cuda.{fn}"
            except Exception:
                pass
        if self._cuda_total is not None:
            figures["limit_bytes"] = self._cuda_total
            sources["limit_bytes"] = "torch.cuda.get_device_properties().total_memory"

    def _accelerator(self, figures: dict[str, Any], sources: dict[str, str]) -> None:
        """``torch.accelerator.memory_*``: a backend without allocator statistics raises, and the figure stays
        unknown (TorchTPU registers an allocator; whether it answers is not verified without a TPU)."""
        acc = self._torch.accelerator
        for key, fn in (
            ("allocated_bytes", "memory_allocated"),
            ("reserved_bytes", "memory_reserved"),
            ("peak_bytes", "max_memory_allocated"),
        ):
            try:
                figures[key] = int(getattr(acc, fn)())
                sources[key] = f"torch.accelerator.{fn}"
            except Exception:
                pass

    def _tpu_monitoring(self, figures: dict[str, Any], sources: dict[str, str]) -> None:
        now = time.monotonic()
        if now - self._libtpu_at >= LIBTPU_EVERY_S:
            self._libtpu_at = now
            try:
                used = _first_int(self._libtpu.get_metric("hbm_capacity_usage").data())
                total = _first_int(self._libtpu.get_metric("hbm_capacity_total").data())
            except Exception:
                used, total = None, None
            self._libtpu_last = (used, total)
        else:
            return  # not read this step: unknown, not the last value again
        used, total = self._libtpu_last
        if used is not None:
            figures["device_used_bytes"] = used
            sources["device_used_bytes"] = "libtpu.sdk.tpumonitoring hbm_capacity_usage"
        if total is not None:
            figures["limit_bytes"] = total
            sources["limit_bytes"] = "libtpu.sdk.tpumonitoring hbm_capacity_total"
