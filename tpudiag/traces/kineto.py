"""Reading Kineto / Chrome trace-event JSON (torch.profiler's ``export_chrome_trace``) into a ``KinetoTrace``.

Timestamps: ``ts``/``dur`` are microseconds; Kineto adds ``baseTimeNanoseconds`` so that
``epoch_ns = baseTimeNanoseconds + ts * 1000``.  Only complete events (``ph == "X"``) become rows; metadata
events give process and thread names.

Reading streams: the (possibly gzipped) file is decompressed chunk by chunk, split into batches of whole events
(``jsonsplit.EventSplitter``) and decoded by msgspec into typed structs, with each event's ``args`` kept as raw JSON
and only the few fields tpudiag needs decoded (``kineto_columns`` builds the columns, ``kineto_args`` reads the
args).  Memory is the columnar result, never the JSON document.  ``kineto_tables`` turns the trace into the
trace_events and steps tables.
"""

from __future__ import annotations

import collections
import queue
import re
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tpudiag.errors import ImportFormatError
from tpudiag.traces import decodepool
from tpudiag.traces.jsonsplit import EventSplitter, StreamFormatError
from tpudiag.traces.kineto_columns import EVENTS, Builder, KinetoTrace, Part

READ_CHUNK = 1 << 20  # compressed bytes read at a time
_QUEUED_CHUNKS = 4  # decompressed chunks waiting for the decoder (bounds memory)
PARALLEL_MIN_BYTES = 4 << 20  # smaller files decode in-process (forking a worker would cost more than it saves)
_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)

Progress = Callable[[int], None]  # called with the number of events read so far

_ANY = msgspec.json.Decoder()


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


def _finish(path: Path, builder: Builder, meta: Any) -> KinetoTrace:
    trace = builder.finish(meta if isinstance(meta, dict) else {})
    if trace.rank is None and (m := _RANK_IN_NAME.search(path.name)):
        trace.rank = int(m.group(1))
    return trace


def _decode_into(builder: Builder, splitter: EventSplitter, batch: bytes | None) -> None:
    """Decode one batch into ``builder``.  A batch whose fast cut fell inside an event does not decode: the splitter
    then gives back those bytes split exactly (and splits exactly from there on)."""
    while batch is not None:
        try:
            events = EVENTS.decode(batch)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if not splitter.fast:
                raise
            batch = splitter.reject()
            continue
        builder.add(events)
        return


def _read(path: Path, progress: Progress | None) -> tuple[Builder, Any]:
    splitter = EventSplitter()
    builder = Builder()

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
        self.builder = Builder()

    def __call__(self, batch: bytes) -> tuple[Part, tuple[list[str], list[str], list[Any]]]:
        return self.builder.code(EVENTS.decode(batch)), self.builder.keys()


@dataclass
class _Pending:
    """A batch on its way into the builder: decoded here (``part``), in the worker (no part yet) or failed."""

    source: tuple[bytes, ...]  # the splitter's ``last_source`` for this batch
    chunk: int  # number of the chunk it was cut from
    part: Part | None = None
    failed: bool = False


def _read_parallel(path: Path, progress: Progress | None) -> tuple[Builder, Any]:
    """``_read`` with the batches decoded by whichever of two processes is free, appended in file order.

    A batch that does not decode (a fast cut inside an event) is handled as ``_read`` does: from that batch on the
    bytes are split exactly and decoded here; the batches cut after it are void and their chunks are fed again.
    """
    splitter = EventSplitter()
    builder = Builder()
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
                    pending.part = builder.code(EVENTS.decode(batch))
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
    builder = Builder()
    try:
        builder.add(EVENTS.decode(msgspec.json.encode([e for e in events if isinstance(e, dict)])))
    except msgspec.ValidationError as err:
        raise ImportFormatError(f"{origin}: not a valid Chrome/Kineto trace ({err})") from None
    return builder.finish(meta)
