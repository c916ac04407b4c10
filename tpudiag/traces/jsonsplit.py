"""Split a Chrome trace JSON byte stream into batches of whole events, with bounded memory.

A Kineto trace is one JSON object whose ``traceEvents`` array holds every event; a 1 M-event trace is ~300 MB of
text.  Rather than holding the document (and a million Python dicts) at once, ``EventSplitter`` is fed the byte
stream in chunks and returns, per chunk, the JSON text of an array holding the complete events seen so far, which a
typed ``msgspec`` decoder turns into objects.  Only the partial event at a chunk's end is carried over.

Event boundaries need the JSON nesting depth outside strings.  It is computed with numpy over the positions of
quotes and brackets only (a per-byte Python loop would be ~100× slower): a bracket is structural when an even
number of unescaped quotes precedes it, and the depth is the running sum of opens minus closes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_QUOTE, _BACKSLASH = 34, 92
_OPEN_OBJ, _CLOSE_OBJ, _OPEN_ARR, _CLOSE_ARR = 123, 125, 91, 93
_COMMA = 44
_KEY = b'"traceEvents"'
_IS_BRACKET = np.zeros(256, dtype=bool)
_IS_BRACKET[[_OPEN_OBJ, _CLOSE_OBJ, _OPEN_ARR, _CLOSE_ARR]] = True
_WS = b" \t\r\n"

Positions = np.ndarray[Any, np.dtype[np.intp]]


class StreamFormatError(ValueError):
    """The stream is not a (complete) Chrome trace; the message says why."""


class _Scanner:
    """String state across chunks: which quotes are unescaped, and whether a chunk ends inside a string."""

    def __init__(self) -> None:
        self.in_string = False
        self.backslashes = 0  # length of the backslash run that ended the previous chunk

    def structural(self, a: np.ndarray[Any, Any]) -> tuple[Positions, np.ndarray[Any, Any]]:
        """Positions and bytes of the brackets outside strings in chunk ``a``; advances the string state."""
        quotes = self._unescaped_quotes(a)
        brackets = np.flatnonzero(_IS_BRACKET[a])
        before = np.searchsorted(quotes, brackets)
        outside = brackets[((before + int(self.in_string)) & 1) == 0]
        self.in_string = bool((len(quotes) + int(self.in_string)) & 1)
        return outside, a[outside]

    def _unescaped_quotes(self, a: np.ndarray[Any, Any]) -> Positions:
        quotes = np.flatnonzero(a == _QUOTE)
        bs = a == _BACKSLASH
        carried = self.backslashes
        if not bs.any():
            self.backslashes = 0
            if carried & 1 and len(quotes) and quotes[0] == 0:
                return quotes[1:]
            return quotes
        trailing = 0  # backslashes at the chunk's end (carried into the next chunk)
        while trailing < len(a) and a[len(a) - 1 - trailing] == _BACKSLASH:
            trailing += 1
        self.backslashes = len(a) + carried if trailing == len(a) else trailing
        drop = []
        candidates = quotes[bs[np.maximum(quotes - 1, 0)] & (quotes > 0)].tolist()
        if len(quotes) and quotes[0] == 0 and carried & 1:
            drop.append(0)
        for q in candidates:
            k = q - 1
            while k >= 0 and bs[k]:
                k -= 1
            if (q - 1 - k + (carried if k < 0 else 0)) & 1:
                drop.append(q)
        if drop:
            quotes = np.setdiff1d(quotes, np.asarray(drop, dtype=quotes.dtype), assume_unique=True)
        return quotes


class EventSplitter:
    """Feed chunks of a Chrome trace; get back JSON arrays of whole events; ``finish`` returns the rest.

    The rest (every top-level key but ``traceEvents``, e.g. ``baseTimeNanoseconds``, ``distributedInfo``) is the
    JSON text of the root object with an empty ``traceEvents`` list, or None when the root is a bare list.
    """

    def __init__(self) -> None:
        self._phase = "head"  # head -> events -> tail
        self._head = bytearray()
        self._tail = bytearray()
        self._carry = b""  # bytes of the event still open at the last chunk's end (already scanned)
        self._scanner = _Scanner()
        self._depth = 0
        self._level = 0  # nesting depth inside the events array
        self._root_is_list = False
        # Fast mode: cut after the last "}," of each chunk without scanning; the caller decodes the batch and calls
        # ``reject`` if it is not valid JSON, which happens exactly when the cut was not between two events (a cut
        # inside a string or a nested object leaves it unterminated).  Then the same bytes are split exactly.
        self.fast = True
        self._pending = b""  # fast mode: the bytes after the last cut (which is between two events)
        self._last: tuple[bytes, ...] = ()  # fast mode: the bytes the last batch was cut from

    def feed(self, chunk: bytes) -> bytes | None:
        if not chunk:
            return None
        if self._phase == "head":
            self._head += chunk
            rest = self._find_events_start()
            if rest is None:
                return None
            chunk = rest
        if self._phase == "tail":
            self._tail += chunk
            return None
        if self.fast:
            return self._fast_cut(chunk)
        return self._scan_events(chunk)

    def reject(self) -> bytes | None:
        """The last batch did not decode: split the same bytes exactly, and stay exact for the rest."""
        buf, self._last = b"".join(self._last), ()
        return self._go_exact(buf)

    @property
    def last_source(self) -> tuple[bytes, ...]:
        """Fast mode: the bytes the last batch was cut from (with what follows the cut), for ``reject_from``."""
        return self._last

    def reject_from(self, source: tuple[bytes, ...]) -> bytes | None:
        """An earlier batch did not decode (its ``last_source`` was ``source``): split again exactly from it.  The
        caller feeds again every chunk fed after that batch's chunk; whatever was split from them is void."""
        self._phase = "events"
        self._tail = bytearray()
        self._last = source
        return self.reject()

    def drain(self) -> bytes | None:
        """At the end of the stream: the events fast mode still holds back (call before ``finish``)."""
        return self._go_exact(self._pending) if self.fast and self._phase == "events" else None

    def _go_exact(self, buf: bytes) -> bytes | None:
        self.fast = False
        self._pending = b""
        self._scanner = _Scanner()
        self._depth = self._level
        self._carry = b""
        return self._scan_events(buf) if buf else None

    def _fast_cut(self, chunk: bytes) -> bytes | None:
        pos = chunk.rfind(b"},")
        if pos < 0:  # no cut in this chunk (or one across the boundary): keep it with the pending bytes
            buf = self._pending + chunk
            pos = buf.rfind(b"},")
            if pos < 0:
                self._pending = buf
                return None
            self._last, self._pending = (buf,), buf[pos + 1 :]
            return _array_of(b"", buf, pos + 1)
        # The batch is the pending bytes and the chunk up to the cut, copied once (into the batch itself).
        self._last, pending, self._pending = (self._pending, chunk), self._pending, chunk[pos + 1 :]
        return _array_of(pending, chunk, pos + 1)

    def finish(self) -> bytes | None:
        if self._phase == "head":
            if not bytes(self._head).strip(_WS):
                raise StreamFormatError("empty file")
            raise StreamFormatError("no traceEvents list: not a Chrome/Kineto trace")
        if self._phase == "events":
            raise StreamFormatError("truncated: the traceEvents list never ends")
        if self._root_is_list:
            if bytes(self._tail[1:]).strip(_WS):
                raise StreamFormatError("unexpected data after the event list")
            return None
        return bytes(self._head) + bytes(self._tail)

    # -- head: find the events array ----------------------------------------------------------------------------
    def _find_events_start(self) -> bytes | None:
        head = bytes(self._head)
        stripped = head.lstrip(_WS)
        if not stripped:
            return None
        if stripped[:1] == b"[":
            self._root_is_list = True
            return self._enter_events(head, len(head) - len(stripped) + 1, level=1)
        if stripped[:1] != b"{":
            raise StreamFormatError("not JSON (expected an object or a list)")
        pos = head.find(_KEY)
        while pos >= 0:
            scanner = _Scanner()
            _, chars = scanner.structural(np.frombuffer(head[:pos], dtype=np.uint8))
            depth = int(np.sum(np.where((chars == _OPEN_OBJ) | (chars == _OPEN_ARR), 1, -1)))
            if not scanner.in_string and depth == 1:
                after = head[pos + len(_KEY) :].lstrip(_WS)
                value = after[1:].lstrip(_WS)
                if not after or (after[:1] == b":" and not value):
                    return None  # the value has not arrived yet
                if after[:1] == b":" and value[:1] == b"[":
                    return self._enter_events(head, len(head) - len(value) + 1, level=2)
                raise StreamFormatError("traceEvents is not a list")
            pos = head.find(_KEY, pos + 1)
        return None

    def _enter_events(self, head: bytes, start: int, level: int) -> bytes:
        self._phase = "events"
        self._level = self._depth = level
        self._head = bytearray(head[:start])
        return head[start:]

    # -- events -------------------------------------------------------------------------------------------------
    def _scan_events(self, chunk: bytes) -> bytes | None:
        offset = len(self._carry)
        buf = self._carry + chunk if offset else chunk
        outside, chars = self._scanner.structural(np.frombuffer(chunk, dtype=np.uint8))
        depth_after = self._depth + np.cumsum(np.where((chars == _OPEN_OBJ) | (chars == _OPEN_ARR), 1, -1))
        level = self._level
        starts = outside[(chars == _OPEN_OBJ) & (depth_after == level + 1)] + offset
        ends = outside[(chars == _CLOSE_OBJ) & (depth_after == level)] + offset
        closing = np.flatnonzero(depth_after < level)
        if len(depth_after):
            self._depth = int(depth_after[-1])
        if len(closing):
            at = int(outside[closing[0]])
            if chars[closing[0]] != _CLOSE_ARR:
                raise StreamFormatError("malformed JSON in traceEvents")
            end_of_array = at + offset
            starts, ends = starts[starts < end_of_array], ends[ends < end_of_array]
            self._phase = "tail"
            self._tail += buf[end_of_array:]
        first = 0 if offset else (int(starts[0]) if len(starts) else -1)
        open_start = int(starts[-1]) if len(starts) and (not len(ends) or starts[-1] > ends[-1]) else -1
        if self._phase != "events":
            self._carry = b""
        elif open_start >= 0:
            self._carry = buf[open_start:]
        elif offset and not len(ends):
            self._carry = buf  # one event longer than a chunk: keep growing
        else:
            self._carry = b""
        if not len(ends) or first < 0:
            return None
        return b"[" + buf[first : int(ends[-1]) + 1] + b"]"


def _array_of(pending: bytes, chunk: bytes, end: int) -> bytes:
    """The JSON array text of the events in ``pending + chunk[:end]``: leading whitespace and the comma that
    separated them from the previous batch dropped, wrapped in brackets, copied once."""
    head = pending.lstrip(_WS)
    start = 0
    if not head:  # the separator may be in the chunk
        while start < end and chunk[start] in _WS:
            start += 1
        if start < end and chunk[start] == _COMMA:
            start += 1
    elif head[:1] == b",":
        head = head[1:]
    return b"".join((b"[", head, memoryview(chunk)[start:end], b"]"))
