"""The ``args`` of Kineto events as Arrow columns: the raw JSON text of each event's ``args``, and the few fields
tpudiag reads from it (``External id``, ``correlation``, ``Sequence number``, ``Input Dims``, ``Input type``).

A batch's args are joined into one buffer and decoded in one msgspec call; only a batch with odd values (a string
id, a non-object) falls back to decoding event by event.  ``Input Dims`` and ``Input type`` stay JSON text,
compacted without a Python loop over the characters.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa


class _Args(msgspec.Struct, gc=False):
    external_id: int | None = msgspec.field(default=None, name="External id")
    correlation: int | None = None
    seq: int | None = msgspec.field(default=None, name="Sequence number")
    dims: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input Dims")
    types: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input type")


_ARGS = msgspec.json.Decoder(_Args)
_ARGS_LIST = msgspec.json.Decoder(list[_Args])
_ANY = msgspec.json.Decoder()


def args_columns(raws: list[msgspec.Raw]) -> list[pa.Array]:
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
