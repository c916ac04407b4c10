"""The columns of an XSpace's events as tpudiag holds them while reading: ``EventColumns`` (kinds, groups and
per-event arrays, turned into xprof Events-DB-shaped tables), the accumulator ``Columns`` the line readers append
to, and ``concatenate`` for two reads of consecutive runs of planes (the parallel read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

Array = np.ndarray[Any, Any]

# Events DB columns fixed by an event's kind: its line and metadata, and its own stats where they change a
# column (not only trace_args), in the Events DB's order.
KIND_COLUMNS: dict[str, pa.DataType] = {
    "device": pa.string(),
    "stream_id": pa.int64(),
    "thread_id": pa.int64(),
    "thread_name": pa.string(),
    "correlation_id": pa.int64(),
    "kernel_name": pa.string(),
    "kernel_details": pa.string(),
    "tf_op_name": pa.string(),
    "tf_op_type": pa.string(),
    "hlo_op": pa.string(),
    "hlo_module": pa.string(),
    "category": pa.string(),
    "flops": pa.float64(),
    "memory_accessed": pa.float64(),
}


@dataclass(frozen=True)
class EventColumns:
    """Events of an XSpace in two levels of sharing.

    A *group* is a (line, metadata, own stats) triple: its trace_args are fixed.  A *kind* is what fixes every other
    column: usually (line, metadata), so a TPU op whose events differ only in a per-step ``group_id`` is one kind
    and one group per step.  Per event: its group, times and step.
    """

    kinds: dict[str, list[Any]]  # KIND_COLUMNS and the kind's trace_args, one entry per kind
    group_kind: Array  # int64 per group: index into kinds
    group_own: Array  # int64 per group: index into own_pairs (-1: the kind's trace_args are the group's)
    own_pairs: list[str]  # "key=value,..." of own stats that only add trace_args pairs
    group: Array  # int64 per event: index into groups
    start_ns: Array
    end_ns: Array
    self_time_ns: Array
    step_code: Array  # int64 per event: index into step_names, -1 for none
    step_names: list[str]

    @property
    def num_rows(self) -> int:
        return len(self.group)

    @property
    def trace_args(self) -> list[str | None]:
        """Per group: the kind's trace_args, then its own pairs."""
        kind_args: list[str | None] = self.kinds["trace_args"]
        out: list[str | None] = []
        for k, o in zip(self.group_kind.tolist(), self.group_own.tolist(), strict=True):
            base = kind_args[k]
            out.append(base if o < 0 else f"{base},{self.own_pairs[o]}" if base else self.own_pairs[o])
        return out

    @property
    def kind(self) -> Array:
        """Kind of each event."""
        return self.group_kind[self.group] if len(self.group) else self.group

    def group_table(self) -> pa.Table:
        kinds = pa.table({c: pa.array(self.kinds[c], typ) for c, typ in KIND_COLUMNS.items()})
        groups = kinds.take(pa.array(self.group_kind, pa.int64()))
        return groups.append_column("trace_args", pa.array(self.trace_args, pa.string()))

    def step(self) -> pa.Array:
        names = pa.array([*self.step_names, None], pa.string())
        return names.take(pa.array(np.where(self.step_code < 0, len(self.step_names), self.step_code)))

    def table(self) -> pa.Table:
        """One row per event, with the Events DB's columns."""
        n = self.num_rows
        out = self.group_table().take(pa.array(self.group))
        columns = dict(zip(out.column_names, out.columns, strict=True))
        columns["self_time_ns"] = pa.array(self.self_time_ns)
        columns["step"] = self.step()
        columns["start_ns"] = pa.array(self.start_ns)
        columns["end_ns"] = pa.array(self.end_ns)
        names = [*KIND_COLUMNS, "trace_args"]
        order = [*names[:11], "self_time_ns", "step", *names[11:], "start_ns", "end_ns"]
        table = pa.table({c: columns[c] for c in order})
        for c, typ in (("input_tensors", pa.list_(pa.string())), ("output_tensors", pa.list_(pa.string()))):
            table = table.append_column(c, pa.nulls(n, typ))
        for c in ("hlo_fingerprint", "flow"):
            table = table.append_column(c, pa.nulls(n, pa.uint64()))
        return table.append_column("source_line", pa.nulls(n, pa.string()))


def concatenate(head: EventColumns, tail: EventColumns) -> EventColumns:
    """The events of ``head`` then ``tail`` as if read in one pass: kinds, groups and own pairs renumbered, step
    names merged in first-seen order."""
    step_index = {name: i for i, name in enumerate(head.step_names)}
    step_map = np.array([step_index.setdefault(name, len(step_index)) for name in tail.step_names] + [-1], np.int64)
    return EventColumns(
        kinds={c: values + tail.kinds[c] for c, values in head.kinds.items()},
        group_kind=np.concatenate((head.group_kind, tail.group_kind + len(head.kinds["device"]))),
        group_own=np.concatenate(
            (head.group_own, np.where(tail.group_own < 0, -1, tail.group_own + len(head.own_pairs)))
        ),
        own_pairs=head.own_pairs + tail.own_pairs,
        group=np.concatenate((head.group, tail.group + len(head.group_kind))),
        start_ns=np.concatenate((head.start_ns, tail.start_ns)),
        end_ns=np.concatenate((head.end_ns, tail.end_ns)),
        self_time_ns=np.concatenate((head.self_time_ns, tail.self_time_ns)),
        step_code=np.concatenate((head.step_code, step_map[tail.step_code])),
        step_names=list(step_index),
    )


class Columns:
    """Groups and per-event arrays of all planes, appended line by line."""

    def __init__(self) -> None:
        self.kinds: dict[str, list[Any]] = {c: [] for c in [*KIND_COLUMNS, "trace_args"]}
        self.group_kind: list[int] = []
        self.group_own: list[int] = []
        self.own_pairs: list[str] = []
        self.parts: dict[str, list[Array]] = {c: [] for c in ("group", "start_ns", "end_ns", "self", "step")}
        self.step_index: dict[str, int] = {}

    def add_kind(self, row: dict[str, Any], d: dict[str, str | None]) -> tuple[int, str | None, dict[str, str | None]]:
        """A new kind from a full row (KIND_COLUMNS and trace_args): (its index, trace_args, stats dict)."""
        for c, values in self.kinds.items():
            values.append(row[c])
        return len(self.kinds["device"]) - 1, row["trace_args"], d

    def step_code(self, step: str | None) -> int:
        return -1 if step is None else self.step_index.setdefault(step, len(self.step_index))

    def finish(self) -> EventColumns:
        def cat(name: str) -> Array:
            parts = self.parts[name]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

        return EventColumns(
            kinds=self.kinds,
            group_kind=np.array(self.group_kind, dtype=np.int64),
            group_own=np.array(self.group_own, dtype=np.int64),
            own_pairs=self.own_pairs,
            group=cat("group"),
            start_ns=cat("start_ns"),
            end_ns=cat("end_ns"),
            self_time_ns=cat("self"),
            step_code=cat("step"),
            step_names=list(self.step_index),
        )
