"""XPlane stats: the XStats of event metadata and of events, decoded once per distinct serialized form
(``Plane``), and the Events DB columns they give a group of events (``full_row``): ``tf_op``, ``flops``,
``bytes_accessed``, ``program_id`` -> HLO module, ``correlation_id``, ``kernel_details``; the rest as
``trace_args`` ``key=value`` pairs.
"""

from __future__ import annotations

from typing import Any

from tpudiag.traces import xplane_proto
from tpudiag.traces.xplane_columns import Columns

# Stats that become columns (not trace_args) on device lines, as in the Events DB.
_DEVICE_COLUMN_STATS = frozenset({"tf_op", "flops", "bytes_accessed", "correlation_id", "kernel_details"})
Stats = list[tuple[str, str | None]]


# Stats that change an event's columns (beyond trace_args) or make it a host step annotation.
_ROW_STATS = _DEVICE_COLUMN_STATS | {"program_id", "_r", "step_num"}


def _stats(stats: Any, names: dict[int, str]) -> Stats:
    """(name, value as text) of each XStat; ``ref_value`` resolves to the referenced stat metadata's name."""
    out: Stats = []
    for s in stats:
        kind = s.WhichOneof("value")
        if kind == "ref_value":
            text: str | None = names.get(s.ref_value)
        elif kind == "str_value":
            text = s.str_value
        elif kind is None:
            text = None
        elif kind == "bytes_value":
            text = s.bytes_value.hex()
        else:
            text = str(getattr(s, kind))
        out.append((names.get(s.metadata_id, ""), text))
    return out


class Plane:
    """A plane's metadata, with event stats decoded once per distinct serialized form."""

    def __init__(self, plane: Any) -> None:
        self.stat_names = {k: m.name for k, m in plane.stat_metadata.items()}
        self.meta: dict[int, tuple[str, Stats]] = {
            k: (m.display_name or m.name, _stats(m.stats, self.stat_names)) for k, m in plane.event_metadata.items()
        }
        self._own: dict[bytes, Stats] = {b"": []}
        self._pairs: dict[bytes, tuple[int, dict[str, str | None]] | None] = {}
        self._stats: dict[tuple[int, bytes], tuple[str, Stats]] = {}

    def own(self, raw: bytes) -> Stats:
        stats = self._own.get(raw)
        if stats is None:
            stats = self._own[raw] = _stats(xplane_proto.XEvent.FromString(raw).stats, self.stat_names)
        return stats

    def pairs(self, raw: bytes, acc: Columns) -> tuple[int, dict[str, str | None]] | None:
        """Own stats that only add trace_args pairs: (their index in ``acc.own_pairs``, as a dict); else None."""
        if raw not in self._pairs:
            own = self.own(raw)
            if _ROW_STATS.isdisjoint(k for k, _ in own):
                acc.own_pairs.append(",".join(f"{k}={v}" for k, v in own))
                self._pairs[raw] = (len(acc.own_pairs) - 1, dict(own))
            else:
                self._pairs[raw] = None
        return self._pairs[raw]

    def stats(self, key: tuple[int, bytes]) -> tuple[str, Stats]:
        """(name, metadata stats + own stats) of a group (computed once: steps, flows and rows all ask)."""
        found = self._stats.get(key)
        if found is None:
            name, md_stats = self.meta.get(key[0], ("", []))
            found = self._stats[key] = (name, md_stats + self.own(key[1]) if key[1] else md_stats)
        return found


def full_row(
    name: str,
    stats: Stats,
    xla_op: bool,
    on_device: bool,
    modules: dict[str | None, str],
    columns: dict[str, Any],
    prefix: str,
) -> tuple[dict[str, Any], dict[str, str | None]]:
    """A group's columns from all its stats (metadata's, then its own), and the stats as a dict."""
    d = dict(stats)
    if not on_device and "_r" in d and "step_num" in d:
        stats = [*stats, ("step_name", f"{name} {d['step_num']}")]
    return {**_stat_row(stats, xla_op, on_device, modules), **columns, "kernel_name": prefix + name}, d


def _stat_row(stats: Stats, xla_op: bool, on_device: bool, modules: dict[str | None, str]) -> dict[str, Any]:
    d = dict(stats)
    kept = [(k, v) for k, v in stats if not (on_device and k in _DEVICE_COLUMN_STATS)]
    return {
        "correlation_id": stat_int(d.get("correlation_id")) if on_device else None,
        "kernel_details": d.get("kernel_details") if on_device else None,
        "tf_op_name": d.get("tf_op") if xla_op else None,
        "tf_op_type": "" if xla_op else None,
        "hlo_op": "" if xla_op else None,
        "hlo_module": modules.get(d.get("program_id")) if xla_op else None,
        "flops": stat_float(d.get("flops")) if xla_op else None,
        "memory_accessed": stat_float(d.get("bytes_accessed")) if xla_op else None,
        "trace_args": ",".join(f"{k}={v}" for k, v in kept) if kept else None,
    }


def stat_int(text: str | None) -> int | None:
    """An int64 column value; text that is no int64 (e.g. a uint64 id above 2**63) is left out."""
    try:
        value = int(text) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and -(2**63) <= value < 2**63 else None


def stat_float(text: str | None) -> float | None:
    try:
        return float(text) if text is not None else None
    except ValueError:
        return None
