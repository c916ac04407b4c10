"""protowire: column-wise wire decoding equals protobuf's own parse; malformed input is a DecodeError."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from tpudiag.traces import protowire
from tpudiag.traces import xplane_proto as xp

_I64 = st.integers(-(2**63), 2**63 - 1)
_STAT = st.tuples(
    st.integers(0, 2**20),
    st.one_of(
        st.tuples(st.just("int64_value"), _I64),
        st.tuples(st.just("uint64_value"), st.integers(0, 2**64 - 1)),
        st.tuples(st.just("double_value"), st.floats(allow_nan=False)),
        st.tuples(st.just("str_value"), st.text(max_size=20)),
        st.tuples(st.just("ref_value"), st.integers(0, 2**64 - 1)),
    ),
)
_EVENT = st.tuples(_I64, _I64, _I64, st.lists(_STAT, max_size=4))


def _decode(events: list[bytes]) -> tuple[protowire.Fields, np.ndarray, int]:
    lengths = np.array([len(e) for e in events], dtype=np.int64)
    buf = protowire.padded(b"".join(events))
    ends = np.cumsum(lengths)
    return protowire.fields(buf, ends - lengths, ends), buf, len(events)


@settings(max_examples=60, deadline=None)
@given(st.lists(_EVENT, max_size=30))
def test_fields_equal_protobuf(spec: list[tuple[int, int, int, list[tuple[int, tuple[str, object]]]]]) -> None:
    messages = []
    for mid, offset, dur, stats in spec:
        ev = xp.XEvent(metadata_id=mid, offset_ps=offset, duration_ps=dur)
        for sid, (kind, value) in stats:
            setattr(ev.stats.add(metadata_id=sid), kind, value)
        messages.append(ev)
    fields, buf, n = _decode([m.SerializeToString() for m in messages])
    assert fields.scalar(1, n).tolist() == [m.metadata_id for m in messages]
    assert fields.scalar(2, n).tolist() == [m.offset_ps for m in messages]
    assert fields.scalar(3, n).tolist() == [m.duration_ps for m in messages]
    own = fields.select(4)
    owners, first, last = protowire.first_and_last(own.owner)
    assert owners.tolist() == [i for i, m in enumerate(messages) if len(m.stats)]
    for owner, lo, hi in zip(owners.tolist(), own.at[first].tolist(), own.end[last].tolist(), strict=True):
        assert list(xp.XEvent.FromString(buf[lo:hi].tobytes()).stats) == list(messages[owner].stats)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.binary(max_size=6), max_size=40))
def test_distinct_ranges_are_exact(chunks: list[bytes]) -> None:
    buf = protowire.padded(b"".join(chunks))
    ends = np.cumsum([len(c) for c in chunks], dtype=np.int64)
    lo = ends - np.array([len(c) for c in chunks], dtype=np.int64)
    codes, values = protowire.distinct_ranges(buf, lo, ends)
    assert [values[c] for c in codes.tolist()] == chunks
    assert len(set(values)) == len(values)


def test_truncated_or_invalid_messages_are_decode_errors() -> None:
    good = xp.XEvent(metadata_id=3, offset_ps=10**12, duration_ps=5).SerializeToString()
    for bad in (good[:-1], b"\x0a\x05ab", b"\x08" + b"\xff" * 11, b"\x0b", b"\x00\x01"):
        with pytest.raises(DecodeError):
            _decode([bad])
