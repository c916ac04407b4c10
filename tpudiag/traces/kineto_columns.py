"""The columnar builder: decoded Kineto event batches into Arrow columns (``KinetoTrace``).

String columns become integer codes into dictionaries shared by all batches (a trace has a few hundred distinct
names and threads), so no per-event Python string reaches Arrow.  A batch may be coded by another builder (the
forked decode worker) and translated into this one's codes (``Builder.remap``); parts are appended in file order.
Timestamps: ``ts``/``dur`` are microseconds; ``start_ns = baseTimeNanoseconds + ts * 1000`` (epoch ns).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa

from tpudiag.traces.kineto_args import args_columns


class Event(msgspec.Struct, gc=False):
    """One trace event as decoded: the fields tpudiag reads, ``args`` kept as raw JSON."""

    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = ""
    tid: int | str = ""
    ts: float | None = None
    dur: float | None = None
    args: msgspec.Raw = msgspec.Raw()


_PH, _TS, _DUR, _NAME, _CAT, _ARGS_OF = (attrgetter(a) for a in ("ph", "ts", "dur", "name", "cat", "args"))
_THREAD = attrgetter("pid", "tid")
EVENTS = msgspec.json.Decoder(list[Event])  # a batch of whole events: ``[{...}, {...}]``
_ANY = msgspec.json.Decoder()
_DICT = pa.dictionary(pa.int32(), pa.string())
_RAW_COLUMNS = pa.schema(
    [
        ("process", _DICT),
        ("thread", _DICT),
        ("name", _DICT),
        ("category", _DICT),
        ("start_ns", pa.int64()),
        ("dur_ns", pa.int64()),
        ("args", pa.string()),
        ("external_id", pa.int64()),
        ("correlation", pa.int64()),
        ("seq_nr", pa.int64()),
        ("shapes", pa.string()),
        ("dtypes", pa.string()),
    ]
)


@dataclass
class KinetoTrace:
    """The complete events of one Chrome trace file, as Arrow columns (``start_ns`` already in epoch ns).

    ``process``, ``thread``, ``name`` and ``category`` are dictionary-encoded (few distinct values)."""

    base_ns: int = 0
    columns: pa.Table = field(default_factory=_RAW_COLUMNS.empty_table)
    process_names: dict[str, str] = field(default_factory=dict)
    thread_names: dict[tuple[str, str], str] = field(default_factory=dict)
    rank: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.columns.num_rows)


@dataclass
class Part:
    """One batch's columns: codes (name, category, thread pair, start, dur), args columns, and the process/thread
    names its metadata events set (applied in file order when the part is appended)."""

    codes: tuple[np.ndarray[Any, Any], ...] | None = None
    args: list[pa.Array] | None = None
    process_names: dict[str, str] = field(default_factory=dict)
    thread_names: dict[tuple[str, str], str] = field(default_factory=dict)


class Builder:
    """Accumulates decoded event batches as columns.

    String columns become integer codes into dictionaries shared by all batches (a trace has a few hundred
    distinct names and threads), so no per-event Python string reaches Arrow; ``args`` stays the raw JSON text,
    joined into one buffer per batch; the few args fields tpudiag needs are decoded in one call per batch.
    """

    def __init__(self) -> None:
        self.rows = 0
        self.process_names: dict[str, str] = {}
        self.thread_names: dict[tuple[str, str], str] = {}
        self._names: defaultdict[str, int] = _numbering()
        self._categories: defaultdict[str, int] = _numbering()
        self._threads: defaultdict[tuple[int | str, int | str], int] = _numbering()
        self._codes: list[tuple[np.ndarray[Any, Any], ...]] = []  # (name, category, thread pair, start, dur)
        self._args: list[list[pa.Array]] = []  # args, external_id, correlation, seq_nr, shapes, dtypes

    def add(self, events: list[Event]) -> None:
        self.append(self.code(events))

    def append(self, part: Part) -> None:
        self.process_names.update(part.process_names)
        self.thread_names.update(part.thread_names)
        if part.codes is not None and part.args is not None:
            self._codes.append(part.codes)
            self._args.append(part.args)
            self.rows += len(part.codes[3])

    def code(self, events: list[Event]) -> Part:
        """Columns of a batch's complete events (codes into this builder's dictionaries); metadata events are
        recorded.  The caller appends the result (``append``) in file order."""
        # Attribute access through C-level map/attrgetter and codes from defaultdicts whose factory numbers new keys
        # (same codes as ``setdefault(key, len(d))``): no Python-level loop over the events in the common case.
        part = Part()
        ts_list = list(map(_TS, events))
        if list(map(_PH, events)).count("X") == len(events) and None not in ts_list:
            xs = events
        else:
            for e in events:
                if e.ph == "M" and e.args:
                    _metadata_event(e, part)
            xs = [e for e in events if e.ph == "X" and e.ts is not None]
            ts_list = list(map(_TS, xs))
        if not xs:
            return part
        n = len(xs)
        ts = np.fromiter(ts_list, dtype=np.float64, count=n)
        dur = np.array(list(map(_DUR, xs)), dtype=np.float64)  # a missing dur (None) becomes NaN, then 0
        whole = np.floor(ts)
        start = whole.astype(np.int64) * 1000 + np.rint((ts - whole) * 1000).astype(np.int64)
        part.codes = (
            np.fromiter(map(self._names.__getitem__, map(_NAME, xs)), np.int32, n),
            np.fromiter(map(self._categories.__getitem__, map(_CAT, xs)), np.int32, n),
            np.fromiter(map(self._threads.__getitem__, map(_THREAD, xs)), np.int32, n),
            start,
            np.maximum(np.rint(np.nan_to_num(dur) * 1000), 0).astype(np.int64),
        )
        part.args = args_columns(list(map(_ARGS_OF, xs)))
        return part

    def remap(self, part: Part, names: list[str], categories: list[str], threads: list[Any]) -> Part:
        """``part`` coded by another builder whose dictionaries hold ``names``, ``categories``, ``threads`` (in code
        order), with its codes translated to this builder's."""
        if part.codes is None:
            return part
        name, cat, pair, start, dur = part.codes
        maps = [
            np.fromiter(map(mine.__getitem__, keys), np.int32, len(keys))
            for mine, keys in ((self._names, names), (self._categories, categories), (self._threads, threads))
        ]
        codes = (maps[0][name], maps[1][cat], maps[2][pair], start, dur)
        return dataclasses.replace(part, codes=codes)

    def keys(self) -> tuple[list[str], list[str], list[Any]]:
        return list(self._names), list(self._categories), list(self._threads)

    def finish(self, meta: dict[str, Any]) -> KinetoTrace:
        meta = {k: v for k, v in meta.items() if k != "traceEvents"}
        base = meta.get("baseTimeNanoseconds")
        base_ns = int(base) if isinstance(base, int | float) and not isinstance(base, bool) else 0
        table = self._table(base_ns)
        dist = meta.get("distributedInfo")
        rank = dist.get("rank") if isinstance(dist, dict) else None
        return KinetoTrace(
            base_ns=base_ns,
            columns=table,
            process_names=self.process_names,
            thread_names=self.thread_names,
            rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
            metadata=meta,
        )

    def _table(self, base_ns: int) -> pa.Table:
        if not self._codes:
            return _RAW_COLUMNS.empty_table()
        name, cat, pair, start, dur = (np.concatenate(c) for c in zip(*self._codes, strict=True))
        # thread pairs -> process and thread strings, each dictionary-encoded
        pairs = list(self._threads)
        procs: dict[str, int] = {}
        tids: dict[str, int] = {}
        proc_of = np.fromiter([procs.setdefault(str(p), len(procs)) for p, _ in pairs], np.int32, len(pairs))
        tid_of = np.fromiter([tids.setdefault(str(t), len(tids)) for _, t in pairs], np.int32, len(pairs))
        arrays: list[pa.Array | pa.ChunkedArray] = [
            _dictionary(proc_of[pair], procs),
            _dictionary(tid_of[pair], tids),
            _dictionary(name, self._names),
            _dictionary(cat, self._categories),
            pa.array(start + base_ns),
            pa.array(dur),
        ]
        arrays += [pa.chunked_array([b[k] for b in self._args], _RAW_COLUMNS.field(6 + k).type) for k in range(6)]
        return pa.Table.from_arrays(arrays, schema=_RAW_COLUMNS)


def _metadata_event(e: Event, part: Part) -> None:
    if e.name not in ("process_name", "thread_name"):
        return
    try:
        a = _ANY.decode(e.args)
    except msgspec.DecodeError:
        return
    if not isinstance(a, dict):
        return
    if e.name == "process_name":
        part.process_names[str(e.pid)] = str(a.get("name", ""))
    else:
        part.thread_names[(str(e.pid), str(e.tid))] = str(a.get("name", ""))


def _numbering() -> defaultdict[Any, int]:
    """A dict that gives each new key the next integer (0, 1, ...) on first lookup, in C (no Python callback)."""
    return defaultdict(itertools.count().__next__)


def _dictionary(codes: np.ndarray[Any, Any], values: dict[str, int]) -> pa.DictionaryArray:
    return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(list(values), pa.string()))
