"""tpudiag's own work inside the script while a profiler records: one labelled range, nothing recorded beneath it.

The numerics checker's float64 replays and comparisons run on the script's thread, between its ops. While a trace
window (or the script's own ``torch.profiler`` session) records, every op of that work would be an event: ten times
the script's own events in a window that checks every op (11,700 events a step against ~900 on the long-run bench's
MLP), ~3 KB of host memory each until the window is exported (+200 MB at its close), and in the script's own trace
ops the script never ran.  Inside a ``tpudiag::`` range torch's ``RecordFunction`` is switched off for the thread, so
a trace holds the range (its duration: tpudiag's own time, which ``tpudiag.traces.kineto_tables`` marks as such) and
none of the ops beneath it.  Nested ranges switch it back on only when the outermost one ends.
"""

from __future__ import annotations

import contextlib
import threading
from types import TracebackType
from typing import Any

_local = threading.local()


class _ToolRange:
    __slots__ = ("_range",)

    def __init__(self, name: str) -> None:
        import torch

        self._range: Any = torch.autograd.profiler.record_function(name)

    def __enter__(self) -> None:
        import torch

        self._range.__enter__()
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        if depth == 0:
            torch._C._autograd._enable_record_function(False)

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        import torch

        _local.depth -= 1
        if _local.depth == 0:
            torch._C._autograd._enable_record_function(True)
        self._range.__exit__(kind, err, tb)


_NOTHING = contextlib.nullcontext()  # reusable: one for every call made with no profiler recording


def tool_range(name: str) -> _ToolRange | contextlib.nullcontext[None]:
    """``with tool_range("tpudiag::numerics"):`` around tpudiag's own torch work; free when no profiler records."""
    import torch

    if torch._C._autograd._profiler_enabled():
        return _ToolRange(name)
    return _NOTHING
