"""Protobuf wire format decoded column-wise with numpy: the fields of many small messages at once.

Parsing a million ``XEvent`` messages into Python objects costs microseconds each; their wire format is simple
(a few varints and length-delimited stats), so the fields of every message are decoded together, one field
position per round: round *k* reads the *k*-th field of every message that still has bytes left.  A message of
*r* fields costs *r* vectorised rounds over the messages that long, never a Python step per message.

Malformed input (a varint longer than 10 bytes, a field running past its message, a group or unknown wire type,
field number 0) raises ``google.protobuf.message.DecodeError``, like the protobuf runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

Array = np.ndarray[Any, Any]
_PAD = 16  # zero bytes after the data, so reads near the end never index past the buffer
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclass(frozen=True)
class Fields:
    """Every field of every message: owner (message index), number, value, in decoding rounds (the k-th field
    of every message, then the (k+1)-th...); ``select`` returns one field number in wire order per message.

    ``value`` is the varint or fixed-width value (uint64; reinterpret for signed or double fields); for
    length-delimited fields ``start``/``end`` are the payload's byte range in the buffer; ``at`` is where the
    field (its tag) begins.
    """

    owner: Array
    number: Array
    value: Array
    start: Array
    end: Array
    at: Array

    def select(self, number: int) -> Fields:
        """The fields numbered ``number``, sorted by owner (rounds are in wire order, so a stable sort keeps it)."""
        keep = np.flatnonzero(self.number == number)
        keep = keep[np.argsort(self.owner[keep], kind="stable")]
        return Fields(*(col[keep] for col in (self.owner, self.number, self.value, self.start, self.end, self.at)))

    def scalar(self, number: int, count: int, dtype: Any = np.int64) -> Array:
        """A non-repeated scalar field per message (0 where absent; the last occurrence wins, as in protobuf)."""
        out = np.zeros(count, dtype=np.uint64)
        keep = self.number == number
        out[self.owner[keep]] = self.value[keep]  # in round order: the last assignment (last occurrence) wins
        return out.view(np.int64).astype(dtype, copy=False) if dtype is not np.uint64 else out


def padded(data: bytes) -> Array:
    """``data`` as a uint8 array with zero padding for the decoder."""
    buf = np.zeros(len(data) + _PAD, dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return buf


def _varint(buf: Array, pos: Array) -> tuple[Array, Array]:
    """Varints at ``pos`` -> (values as uint64, position after each); later bytes only for the varints that go on."""
    b = buf[pos]
    value = (b & 0x7F).astype(np.uint64)
    size = np.ones(len(pos), dtype=np.int64)
    more = np.flatnonzero(b & 0x80)
    shift = 7
    while len(more):
        if shift > 63:
            raise DecodeError("varint longer than 10 bytes")
        b = buf[pos[more] + size[more]]
        value[more] |= (b & 0x7F).astype(np.uint64) << np.uint64(shift)
        size[more] += 1
        more = more[(b & 0x80) != 0]
        shift += 7
    return value, pos + size


def varint_at(data: bytes, pos: int) -> tuple[int, int] | None:
    """The one varint starting at ``data[pos]`` -> (value, position after it); None when ``data`` ends inside it
    or it is longer than 10 bytes (a file sniffer's question: is this plausibly a protobuf length?)."""
    if pos >= len(data):
        return None
    chunk = data[pos : pos + 10]
    try:
        value, end = _varint(padded(chunk), np.zeros(1, dtype=np.int64))
    except DecodeError:
        return None
    size = int(end[0])
    if size > len(chunk) or chunk[size - 1] & 0x80:
        return None
    return int(value[0]), pos + size


def _fixed(buf: Array, pos: Array, width: int) -> Array:
    raw = buf[pos[:, None] + np.arange(width)]
    return np.ascontiguousarray(raw).view(f"<u{width}").ravel().astype(np.uint64)


def fields(buf: Array, starts: Array, ends: Array) -> Fields:
    """Decode the top-level fields of the messages ``buf[starts[i]:ends[i]]`` (``buf`` from :func:`padded`)."""
    parts: list[tuple[Array, ...]] = []
    cur = starts.astype(np.int64, copy=True)
    live = np.flatnonzero(cur < ends)
    if (cur > ends).any() or (len(ends) and ends.max() > len(buf) - _PAD):
        raise DecodeError("message range outside the data")
    while len(live):
        c = at = cur[live]
        end = ends[live]
        tag, c = _varint(buf, c)
        number = (tag >> np.uint64(3)).astype(np.int64)
        wire = (tag & np.uint64(7)).astype(np.int64)
        value = np.zeros(len(live), dtype=np.uint64)
        vstart = c.copy()
        after = c.copy()
        for kind in np.unique(wire).tolist():
            sel = np.flatnonzero(wire == kind)
            if kind == _VARINT:
                value[sel], after[sel] = _varint(buf, c[sel])
            elif kind == _I64:
                value[sel], after[sel] = _fixed(buf, c[sel], 8), c[sel] + 8
            elif kind == _I32:
                value[sel], after[sel] = _fixed(buf, c[sel], 4), c[sel] + 4
            elif kind == _LEN:
                length, vstart[sel] = _varint(buf, c[sel])
                if (length > np.uint64(2**62)).any():
                    raise DecodeError("length-delimited field too long")
                value[sel] = length
                after[sel] = vstart[sel] + length.astype(np.int64)
            else:
                raise DecodeError(f"unsupported wire type {kind}")
        if (after > end).any() or (number == 0).any():
            raise DecodeError("truncated message or invalid field number")
        parts.append((live, number, value, vstart, after, at))
        cur[live] = after
        live = live[after < end]
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return Fields(empty, empty, empty.astype(np.uint64), empty, empty, empty)
    return Fields(*(np.concatenate(col) for col in zip(*parts, strict=True)))


def distinct_ranges(buf: Array, lo: Array, hi: Array) -> tuple[Array, list[bytes]]:
    """Code of each byte range ``buf[lo[i]:hi[i]]`` among the distinct ones, and their bytes (code 0: empty).

    Ranges of one length are hashed column by column and the hash groups checked byte for byte; a collision
    (never seen in practice) falls back to an exact sort of the ranges.
    """
    codes = np.zeros(len(lo), dtype=np.int64)
    values = [b""]
    length = hi - lo
    for size in np.unique(length[length > 0]).tolist():
        sel = np.flatnonzero(length == size)
        rows = buf[lo[sel, None] + np.arange(size)]
        h = np.zeros(len(sel), dtype=np.uint64)
        for j in range(size):
            h = h * np.uint64(1099511628211) + rows[:, j]
        _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
        if not (rows == rows[first[inverse]]).all():
            void = np.ascontiguousarray(rows).view(np.dtype((np.void, size))).ravel()
            _, first, inverse = np.unique(void, return_index=True, return_inverse=True)
        codes[sel] = len(values) + inverse.ravel()
        blob = rows[first].tobytes()
        values.extend(blob[k * size : (k + 1) * size] for k in range(len(first)))
    return codes, values


def dense_codes(values: Array) -> tuple[Array, Array]:
    """(sorted distinct values, code of each value): ``np.unique(values, return_inverse=True)`` in O(n) when the
    values are small non-negative integers (metadata ids, group codes), which they usually are."""
    if len(values) and values.min() >= 0 and values.max() < 4 * len(values) + 1024:
        present = np.zeros(int(values.max()) + 1, dtype=bool)
        present[values] = True
        distinct = np.flatnonzero(present)
        code_of = np.cumsum(present) - 1
        return distinct, code_of[values]
    distinct, codes = np.unique(values, return_inverse=True)
    return distinct, codes.ravel()


def first_and_last(owner: Array) -> tuple[Array, Array, Array]:
    """For a sorted owner column: each distinct owner, and the index of its first and last entry."""
    if not len(owner):
        return owner, owner, owner
    starts = np.flatnonzero(np.concatenate(([True], owner[1:] != owner[:-1])))
    ends = np.concatenate((starts[1:], [len(owner)])) - 1
    return owner[starts], starts, ends
