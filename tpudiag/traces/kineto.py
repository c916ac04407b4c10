"""Kineto / Chrome trace-event JSON (torch.profiler's ``export_chrome_trace``) into trace_events rows.

Timestamps: ``ts``/``dur`` are microseconds; Kineto adds ``baseTimeNanoseconds`` so that
``epoch_ns = baseTimeNanoseconds + ts * 1000``.  Only complete events (``ph == "X"``) become rows; metadata
events give process and thread names.

Reading streams: the (possibly gzipped) file is decompressed chunk by chunk, split into batches of whole events
(``jsonsplit.EventSplitter``) and decoded by msgspec into typed structs, with each event's ``args`` kept as raw JSON
and only the few fields tpudiag needs decoded.  Memory is the columnar result, never the JSON document.

GPU kernels are linked to the CPU op that launched them: a kernel shares its ``correlation`` id with the
``cuda_runtime``/``cuda_driver`` launch call (``cudaLaunchKernel``, ``cuLaunchKernel``, ``hipLaunchKernel``...), and
the launching op is the innermost ``cpu_op`` around that call.  The kernel row then carries that op's name
(``framework_op``), event id (``launch_id``), module, phase and step.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import re
import threading
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tpudiag.analysis.step_summary import StepSpan
from tpudiag.analysis.steps import detect_steps, step_array
from tpudiag.analysis.tree import attribute_modules, decode, encode, levels_by_depth, nest_arrays
from tpudiag.errors import ImportFormatError
from tpudiag.model import Step, TraceEvent, arrow_schema
from tpudiag.traces import decodepool
from tpudiag.traces.jsonsplit import EventSplitter, StreamFormatError

DEVICE_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
LAUNCH_CATEGORIES = frozenset({"cuda_runtime", "cuda_driver"})
HOST_OP_CATEGORY = "cpu_op"
READ_CHUNK = 1 << 20  # compressed bytes read at a time
_QUEUED_CHUNKS = 4  # decompressed chunks waiting for the decoder (bounds memory)
PARALLEL_MIN_BYTES = 4 << 20  # smaller files decode in-process (forking a worker would cost more than it saves)
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)

Progress = Callable[[int], None]  # called with the number of events read so far


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    pid: int | str = ""
    tid: int | str = ""
    ts: float | None = None
    dur: float | None = None
    args: msgspec.Raw = msgspec.Raw()


class _Args(msgspec.Struct, gc=False):
    external_id: int | None = msgspec.field(default=None, name="External id")
    correlation: int | None = None
    seq: int | None = msgspec.field(default=None, name="Sequence number")
    dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input Dims")
    types: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input type")


_PH, _TS, _DUR, _NAME, _CAT, _ARGS_OF = (attrgetter(a) for a in ("ph", "ts", "dur", "name", "cat", "args"))
_THREAD = attrgetter("pid", "tid")
_EVENTS = msgspec.json.Decoder(list[_Event])
_ARGS = msgspec.json.Decoder(_Args)
_ARGS_LIST = msgspec.json.Decoder(list[_Args])
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


# -- reading -----------------------------------------------------------------------------------------------------
def _byte_chunks(path: Path) -> Iterator[bytes]:
    """The decompressed bytes of a plain or gzip file, a chunk at a time (multi-member gzip included)."""
    with path.open("rb") as f:
        first = f.read(2)
        f.seek(0)
        if first != b"\x1f\x8b":
            while chunk := f.read(READ_CHUNK * 16):
                yield chunk
            return
        d = zlib.decompressobj(wbits=31)
        while comp := f.read(READ_CHUNK):
            while comp:
                try:
                    out = d.decompress(comp)
                except zlib.error as err:
                    raise ImportFormatError(f"{path}: corrupt gzip data ({err})") from None
                if out:
                    yield out
                comp = d.unused_data if d.eof else b""
                if d.eof and comp:
                    d = zlib.decompressobj(wbits=31)
        if not d.eof:
            raise ImportFormatError(f"{path}: truncated gzip file (the compressed stream ends early)")


def _prefetched(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """``chunks`` produced by a background thread: zlib releases the GIL, so decompression overlaps decoding on a
    second core.  At most ``_QUEUED_CHUNKS`` chunks wait; an error in the thread is raised here."""
    q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize=_QUEUED_CHUNKS)
    stop = threading.Event()

    def produce() -> None:
        try:
            for chunk in chunks:
                while not stop.is_set():
                    try:
                        q.put(chunk, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(None)
        except BaseException as err:  # handed to the consumer, never lost in the thread
            q.put(err)

    worker = threading.Thread(target=produce, name="tpudiag-gunzip", daemon=True)
    worker.start()
    try:
        while (item := q.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        worker.join()


def load(path: Path, progress: Progress | None = None, parallel: bool = False) -> KinetoTrace:
    """Read one Chrome/Kineto trace file (plain or gzip) with bounded memory.

    ``parallel``: decode every other batch in a forked second process (for a short-lived process that owns its
    threads, like the import command; never inside a profiled script).  Any failure on that path (a batch the fast
    splitter cut badly, a bad file, a dead worker) reads the file again in-process, so results and errors are the
    in-process ones."""
    if parallel and path.stat().st_size >= PARALLEL_MIN_BYTES and decodepool.fork_available():
        try:
            return _finish(path, *_read_parallel(path, progress))
        except Exception:  # the in-process read below gives the canonical result or error
            pass
    return _finish(path, *_read(path, progress))


def _finish(path: Path, builder: _Builder, meta: Any) -> KinetoTrace:
    trace = builder.finish(meta if isinstance(meta, dict) else {})
    if trace.rank is None and (m := _RANK_IN_NAME.search(path.name)):
        trace.rank = int(m.group(1))
    return trace


def _decode_into(builder: _Builder, splitter: EventSplitter, batch: bytes | None) -> None:
    """Decode one batch into ``builder``.  A batch whose fast cut fell inside an event does not decode: the splitter
    then gives back those bytes split exactly (and splits exactly from there on)."""
    while batch is not None:
        try:
            events = _EVENTS.decode(batch)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if not splitter.fast:
                raise
            batch = splitter.reject()
            continue
        builder.add(events)
        return


def _read(path: Path, progress: Progress | None) -> tuple[_Builder, Any]:
    splitter = EventSplitter()
    builder = _Builder()

    def add(batch: bytes | None) -> None:
        if batch is None:
            return
        _decode_into(builder, splitter, batch)
        if progress is not None:
            progress(builder.rows)

    try:
        for chunk in _prefetched(_byte_chunks(path)):
            add(splitter.feed(chunk))
        add(splitter.drain())
        rest = splitter.finish()
        meta = _ANY.decode(rest) if rest is not None else {}
    except StreamFormatError as err:
        raise ImportFormatError(f"{path}: {err}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as err:
        raise ImportFormatError(f"{path}: not a valid Chrome/Kineto trace ({err})") from None
    return builder, meta


class _RemoteCoder:
    """The worker's side: decodes and codes a batch with its own dictionaries, returned with the part."""

    def __init__(self) -> None:
        self.builder = _Builder()

    def __call__(self, batch: bytes) -> tuple[_Part, tuple[list[str], list[str], list[Any]]]:
        return self.builder.code(_EVENTS.decode(batch)), self.builder.keys()


@dataclass
class _Pending:
    """A batch on its way into the builder: decoded here (``part``), in the worker (no part yet) or failed."""

    source: tuple[bytes, ...]  # the splitter's ``last_source`` for this batch
    chunk: int  # number of the chunk it was cut from
    part: _Part | None = None
    failed: bool = False


def _read_parallel(path: Path, progress: Progress | None) -> tuple[_Builder, Any]:
    """``_read`` with the batches decoded by whichever of two processes is free, appended in file order.

    A batch that does not decode (a fast cut inside an event) is handled as ``_read`` does: from that batch on the
    bytes are split exactly and decoded here; the batches cut after it are void and their chunks are fed again.
    """
    splitter = EventSplitter()
    builder = _Builder()
    waiting: collections.deque[_Pending] = collections.deque()
    fed: list[bytes] = []  # chunks from number ``first_fed`` on (those a failed batch may need again)
    first_fed = 0
    in_process = False

    def add_here(batch: bytes | None) -> None:  # in-process decoding, as ``_read`` does it
        if batch is not None:
            _decode_into(builder, splitter, batch)

    with decodepool.DecodeWorker(_RemoteCoder()) as worker:  # forked before the gunzip thread starts

        def settle(wait: bool) -> _Pending | None:
            """Append the finished batches at the head of the queue; returns the first failed one, if any."""
            while waiting:
                head = waiting[0]
                if head.part is None and not head.failed:
                    if not (wait or worker.ready()):
                        break
                    try:
                        part, keys = worker.result()
                        head.part = builder.remap(part, *keys)
                    except decodepool.WorkerError:
                        head.failed = True
                if head.failed or head.part is None:
                    return head
                builder.append(head.part)
                waiting.popleft()
            if progress is not None:
                progress(builder.rows)
            return None

        def recover(failed: _Pending) -> None:
            nonlocal in_process
            in_process = True
            waiting.clear()
            again = fed[failed.chunk - first_fed + 1 :]
            fed.clear()
            add_here(splitter.reject_from(failed.source))
            for data in again:
                add_here(splitter.feed(data))

        def take(batch: bytes | None, chunk: int) -> None:
            nonlocal first_fed
            if in_process:
                add_here(batch)
                return
            if batch is None:
                return
            pending = _Pending(splitter.last_source, chunk)
            if worker.busy:
                try:
                    pending.part = builder.code(_EVENTS.decode(batch))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pending.failed = True
            else:
                worker.submit(batch)
            waiting.append(pending)
            failed = settle(wait=pending.failed or len(waiting) > _QUEUED_CHUNKS)
            if failed is not None:
                recover(failed)
                return
            keep = waiting[0].chunk if waiting else chunk + 1
            del fed[: keep - first_fed]
            first_fed = keep

        for number, data in enumerate(_prefetched(_byte_chunks(path))):
            if not in_process:
                fed.append(data)
            take(splitter.feed(data), number)
        if not in_process and (failed := settle(wait=True)) is not None:
            recover(failed)
        add_here(splitter.drain())  # the bytes after the last fast cut, split exactly
    if progress is not None:
        progress(builder.rows)
    rest = splitter.finish()
    return builder, _ANY.decode(rest) if rest is not None else {}


def parse(doc: Any, origin: str = "<trace>") -> KinetoTrace:
    """A trace already decoded as plain Python (a dict with ``traceEvents``, or a bare list of events)."""
    if isinstance(doc, list):
        events, meta = doc, {}
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events, meta = doc["traceEvents"], {k: v for k, v in doc.items() if k != "traceEvents"}
    else:
        raise ImportFormatError(f"{origin}: no traceEvents list: not a Chrome/Kineto trace")
    builder = _Builder()
    try:
        builder.add(_EVENTS.decode(msgspec.json.encode([e for e in events if isinstance(e, dict)])))
    except msgspec.ValidationError as err:
        raise ImportFormatError(f"{origin}: not a valid Chrome/Kineto trace ({err})") from None
    return builder.finish(meta)


@dataclass
class _Part:
    """One batch's columns: codes (name, category, thread pair, start, dur), args columns, and the process/thread
    names its metadata events set (applied in file order when the part is appended)."""

    codes: tuple[np.ndarray[Any, Any], ...] | None = None
    args: list[pa.Array] | None = None
    process_names: dict[str, str] = field(default_factory=dict)
    thread_names: dict[tuple[str, str], str] = field(default_factory=dict)


class _Builder:
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

    def add(self, events: list[_Event]) -> None:
        self.append(self.code(events))

    def append(self, part: _Part) -> None:
        self.process_names.update(part.process_names)
        self.thread_names.update(part.thread_names)
        if part.codes is not None and part.args is not None:
            self._codes.append(part.codes)
            self._args.append(part.args)
            self.rows += len(part.codes[3])

    def code(self, events: list[_Event]) -> _Part:
        """Columns of a batch's complete events (codes into this builder's dictionaries); metadata events are
        recorded.  The caller appends the result (``append``) in file order."""
        # Attribute access through C-level map/attrgetter and codes from defaultdicts whose factory numbers new keys
        # (same codes as ``setdefault(key, len(d))``): no Python-level loop over the events in the common case.
        part = _Part()
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
        part.args = _args_columns(list(map(_ARGS_OF, xs)))
        return part

    def remap(self, part: _Part, names: list[str], categories: list[str], threads: list[Any]) -> _Part:
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


def _metadata_event(e: _Event, part: _Part) -> None:
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


def _args_columns(raws: list[msgspec.Raw]) -> list[pa.Array]:
    """args (raw JSON text), External id, correlation, Sequence number, Input Dims and Input type of a batch."""
    n = len(raws)
    lengths = np.fromiter(map(len, raws), dtype=np.int64, count=n)
    has = lengths > 0
    args = _text_array(b"".join(raws), lengths)
    filled = raws if has.all() else list(itertools.compress(raws, has))
    try:
        parsed = _ARGS_LIST.decode(b"[" + b",".join(filled) + b"]")
    except (msgspec.ValidationError, msgspec.DecodeError):
        parsed = [_decode_args(r) or _Args() for r in filled]  # odd values somewhere: field by field
    where = pa.array(np.cumsum(has) - 1, mask=~has)  # row -> position among the events that have args

    def spread(values: pa.Array) -> pa.Array:
        return values.take(where) if len(filled) != n else values

    ints = [
        spread(pa.array([a.external_id for a in parsed], pa.int64())),
        spread(pa.array([a.correlation for a in parsed], pa.int64())),
        spread(pa.array([a.seq for a in parsed], pa.int64())),
    ]
    texts = [spread(_compact_json([a.dims for a in parsed])), spread(_compact_json([a.types for a in parsed]))]
    return [args, *ints, *texts]


def _text_array(data: bytes, lengths: np.ndarray[Any, Any]) -> pa.Array:
    """A string array over one buffer of concatenated UTF-8 values; empty values are null."""
    n = len(lengths)
    large = len(data) >= 1 << 31
    offsets = np.zeros(n + 1, dtype=np.int64 if large else np.int32)
    np.cumsum(lengths, out=offsets[1:])
    valid = lengths > 0
    arr = pa.Array.from_buffers(
        pa.large_string() if large else pa.string(),
        n,
        [pa.py_buffer(np.packbits(valid, bitorder="little")), pa.py_buffer(offsets), pa.py_buffer(data)],
        null_count=int(n - valid.sum()),
    )
    try:
        arr.validate(full=True)
    except pa.ArrowInvalid:  # invalid UTF-8 inside a value: decode value by value, replacing bad bytes
        bounds = offsets.tolist()
        return pa.array(
            [data[a:b].decode("utf-8", "replace") or None for a, b in itertools.pairwise(bounds)],
            pa.string(),
        )
    return arr if not large else arr.cast(pa.string())


_WS = np.zeros(256, dtype=bool)
_WS[[9, 10, 13, 32]] = True


def _compact_json(raws: list[msgspec.Raw]) -> pa.Array:
    """Raw JSON values as compact text (whitespace outside strings removed); missing values are null."""
    n = len(raws)
    lengths = np.fromiter(map(len, raws), dtype=np.int64, count=n)
    data = b"".join(raws)
    if not data:
        return pa.nulls(n, pa.string())
    if b"\\" in data:  # escapes make quote parity unreliable: re-encode value by value
        return pa.array([_raw_text(r) for r in raws], pa.string())
    a = np.frombuffer(data, dtype=np.uint8)
    inside = (np.cumsum(a == 34) & 1).astype(bool)  # 34 = '"'; balanced per value, so parity is per value
    drop = _WS[a] & ~inside
    kept_before = np.concatenate(([0], np.cumsum(~drop)))
    ends = np.cumsum(lengths)
    new_lengths = np.diff(np.concatenate(([0], kept_before[ends])))
    return _text_array(a[~drop].tobytes(), new_lengths)


def _decode_args(raw: msgspec.Raw) -> _Args | None:
    if not raw:
        return None
    try:
        return _ARGS.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        try:
            a = _ANY.decode(raw)
        except msgspec.DecodeError:
            return None
        if not isinstance(a, dict):
            return None
        return _Args(
            external_id=_int_or_none(a.get("External id")),
            correlation=_int_or_none(a.get("correlation")),
            seq=_int_or_none(a.get("Sequence number")),
        )


def _raw_text(raw: msgspec.Raw) -> str | None:
    if not raw:
        return None
    return msgspec.json.encode(_ANY.decode(raw)).decode()


def _int_or_none(v: Any) -> int | None:
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


# -- analysis ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TraceTables:
    events: pa.Table
    steps: list[StepSpan]


def to_tables(
    trace: KinetoTrace,
    run_id: str,
    rank: int = 0,
    first_event_id: int = 0,
    first_step: int = 0,
    module_sources: dict[str, str] | None = None,
    root_inputs: Sequence[str | None] = (),
    source: str = "kineto",
    whole_fallback: bool = True,
) -> TraceTables:
    """Analyse one trace (nesting, self time, modules, steps, kernel launches) and build its trace_events table.

    Columnar throughout: strings are handled once per distinct value through dictionary codes."""
    cols = trace.columns
    n = len(trace)
    start = np.asarray(cols.column("start_ns").to_numpy(), dtype=np.int64)
    dur = np.asarray(cols.column("dur_ns").to_numpy(), dtype=np.int64)
    proc_codes, procs = encode(cols.column("process"))
    tid_codes, tids = encode(cols.column("thread"))
    thread_key = proc_codes * max(len(tids), 1) + tid_codes
    parent, depth, self_ns = nest_arrays(thread_key, start, dur)
    levels = levels_by_depth(depth)  # events grouped by depth, shared by every top-down pass below
    names = cols.column("name")
    attr = attribute_modules(
        names, cols.column("process"), start, cols.column("seq_nr"), parent, module_sources, levels=levels
    )
    steps = detect_steps(names, start, dur, parent, root_inputs, whole_fallback=whole_fallback, levels=levels)
    if first_step and not any(s.kind == "profiler_step" for s in steps):
        steps = [dataclasses.replace(s, step=s.step + first_step) for s in steps]
    cat_codes, cats = encode(cols.column("category"))
    on_device = _in(cat_codes, cats, DEVICE_CATEGORIES)
    launcher = _launching_ops(cat_codes, cats, cols.column("correlation"), parent, on_device, levels)
    linked = launcher >= 0
    # a device event takes the module, phase and step of the op that launched it
    inherit = pa.array(np.where(linked, launcher, np.arange(n)))
    name_codes, distinct_names = encode(names)
    framework_op = decode(np.where(linked, name_codes[np.maximum(launcher, 0)], -1), distinct_names)
    launch_id = np.where(linked, launcher + first_event_id, -1)
    proc_label = [trace.process_names.get(p, p) for p in procs]
    pair_codes, pair_first = np.unique(thread_key, return_index=True)
    thread_label = [
        trace.thread_names.get((procs[proc_codes[i]], tids[tid_codes[i]]), tids[tid_codes[i]])
        for i in pair_first.tolist()
    ]
    columns: dict[str, Any] = {
        "run_id": pa.repeat(run_id, n),
        "event_id": np.arange(first_event_id, first_event_id + n, dtype=np.int64),
        "source": pa.repeat(source, n),
        "process": decode(proc_codes, proc_label),
        "thread": decode(np.searchsorted(pair_codes, thread_key), thread_label),
        "name": names,
        "category": _mark_tool_overhead(cols.column("category"), name_codes, distinct_names, parent, levels),
        "start_ns": start,
        "dur_ns": dur,
        "self_ns": self_ns,
        "depth": depth,
        "parent_id": pa.array(parent + first_event_id, mask=parent < 0),
        "rank": np.full(n, rank, dtype=np.int64),
        "step": step_array(start, steps).take(inherit),
        "module": attr.module.take(inherit),
        "phase": attr.phase.take(inherit),
        "source_loc": attr.source_loc,
        "shapes": cols.column("shapes"),
        "dtypes": cols.column("dtypes"),
        "seq_nr": cols.column("seq_nr"),
        "external_id": cols.column("external_id"),
        "correlation": cols.column("correlation"),
        "on_device": on_device,
        "flops": pa.nulls(n, pa.float64()),
        "bytes_accessed": pa.nulls(n, pa.float64()),
        "framework_op": framework_op,
        "hlo_category": pa.nulls(n, pa.string()),
        "launch_id": pa.array(launch_id, mask=launch_id < 0),
        "args": cols.column("args"),
    }
    # string columns may stay dictionary-encoded (the spool casts, the store ingests them as they are)
    table = pa.table({f.name: _typed(columns[f.name], f.type) for f in arrow_schema(TraceEvent)})
    return TraceTables(events=table, steps=steps)


def _typed(value: Any, typ: pa.DataType) -> pa.Array | pa.ChunkedArray:
    if isinstance(value, pa.Array | pa.ChunkedArray):
        keep = value.type == typ or (pa.types.is_dictionary(value.type) and value.type.value_type == typ)
        return value if keep else value.cast(typ)
    return pa.array(value, typ)


def _in(codes: np.ndarray[Any, Any], distinct: list[str], wanted: frozenset[str]) -> np.ndarray[Any, Any]:
    hit = np.fromiter((v in wanted for v in distinct), dtype=bool, count=len(distinct))
    return hit[codes] if len(codes) else np.zeros(0, dtype=bool)


def _launching_ops(
    cat_codes: np.ndarray[Any, Any],
    cats: list[str],
    correlation: pa.ChunkedArray,
    parent: np.ndarray[Any, Any],
    on_device: np.ndarray[Any, Any],
    levels: list[np.ndarray[Any, Any]],
) -> np.ndarray[Any, np.dtype[np.int64]]:
    """For each device event, the index of the ``cpu_op`` that launched it (-1 when unknown)."""
    n = len(cat_codes)
    out = np.full(n, -1, dtype=np.int64)
    corr = np.asarray(pc.fill_null(correlation, -1).to_numpy(), dtype=np.int64)
    launch = _in(cat_codes, cats, LAUNCH_CATEGORIES) & (corr >= 0)
    device = on_device & (corr >= 0)
    if not launch.any() or not device.any():
        return out
    # innermost cpu_op at or above every event, filled from the roots down
    op_above = np.where(_in(cat_codes, cats, frozenset({HOST_OP_CATEGORY})), np.arange(n), -1)
    for level in levels[1:]:
        own = op_above[level] >= 0
        inherit = level[~own]
        op_above[inherit] = op_above[parent[inherit]]
    launches = np.flatnonzero(launch)
    order = np.argsort(corr[launches], kind="stable")
    keys = corr[launches][order]
    targets = np.flatnonzero(device)
    k = np.searchsorted(keys, corr[targets])
    found = (k < len(keys)) & (keys[np.minimum(k, len(keys) - 1)] == corr[targets])
    runtime = launches[order][np.minimum(k, len(keys) - 1)]
    out[targets[found]] = op_above[runtime[found]]
    return out


def steps_table(steps: Sequence[StepSpan], run_id: str, rank: int = 0) -> pa.Table:
    cols: dict[str, Any] = {
        "run_id": [run_id] * len(steps),
        "step": [s.step for s in steps],
        "start_ns": [s.start_ns for s in steps],
        "dur_ns": [s.dur_ns for s in steps],
        "kind": [s.kind for s in steps],
        "input_shapes": [s.input_shapes for s in steps],
        "rank": [rank] * len(steps),
    }
    return pa.table(cols, schema=arrow_schema(Step))


TOOL_RANGE_PREFIX = "tpudiag::"
TOOL_CATEGORY = "tpudiag_overhead"
DISPATCH_WRAPPER = "PythonDispatchMode"
DISPATCH_CATEGORY = "python_dispatch"


def _mark_tool_overhead(
    category: pa.Array, name_codes: np.ndarray, names: list[str], parent: np.ndarray, levels: list[np.ndarray]
) -> pa.Array:
    """Events inside a ``tpudiag::`` range (the numerics checker's own work) get category ``tpudiag_overhead``.

    They stay in the trace, so the time tpudiag spent is visible, but they are never ranked as the script's ops.
    Names are tested once per distinct value (``names``; ``name_codes`` index it).
    """
    mark = _in_names(name_codes, names, lambda v: v.startswith(TOOL_RANGE_PREFIX))
    # A Python dispatch mode's own wrapper event: its self time is the mode's Python work, not an op of the script
    # (the op it dispatched is its child and keeps its category).
    wrapper = _in_names(name_codes, names, lambda v: v == DISPATCH_WRAPPER)
    if not mark.any() and not wrapper.any():
        return category
    for at in levels[1:]:
        mark[at] |= mark[parent[at]]
    # Under a dispatch mode an op is recorded twice: the outer call, then the mode's re-dispatch inside the wrapper.
    # The inner one holds the real work, so the outer one is dispatch bookkeeping too (an op then counts once).
    outer = parent[np.flatnonzero(wrapper)]
    wrapper[outer[outer >= 0]] = True
    if pa.types.is_dictionary(category.type):
        category = category.cast(pa.string())
    category = pc.if_else(pa.array(wrapper), pa.scalar(DISPATCH_CATEGORY), category)
    return pc.if_else(pa.array(mark), pa.scalar(TOOL_CATEGORY), category)


def _in_names(codes: np.ndarray, names: list[str], test: Callable[[str], bool]) -> np.ndarray:
    hit = np.fromiter(map(test, names), dtype=bool, count=len(names))
    return hit[codes] if len(codes) else np.zeros(0, dtype=bool)
