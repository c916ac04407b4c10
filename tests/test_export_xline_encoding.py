"""The numpy XLine encoder writes exactly what protobuf itself would (parsed back and compared)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tpudiag.exporters.xline_encoding import StatColumn, encode_line_events, varint_sizes
from tpudiag.traces import xplane_proto as xp


def _reference(mid, off, dur, stats):  # type: ignore[no-untyped-def]
    line = xp.XLine()
    for i in range(len(mid)):
        event = line.events.add(metadata_id=int(mid[i]), offset_ps=int(off[i]), duration_ps=int(dur[i]))
        for s in stats:
            if not s.present[i]:
                continue
            stat = event.stats.add(metadata_id=s.metadata_id)
            if s.kind == "double":
                stat.double_value = float(s.values[i])
            elif s.kind == "ref":
                stat.ref_value = int(s.values[i]) % 2**64
            else:
                stat.int64_value = int(s.values[i])
    return line


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 60), seed=st.integers(0, 2**32 - 1), big=st.booleans())
def test_encoded_events_equal_protobuf(n: int, seed: int, big: bool) -> None:
    rng = np.random.default_rng(seed)
    top = 2**62 if big else 300
    mid = rng.integers(1, 2**20, n)
    off = rng.integers(0, top, n)
    dur = rng.integers(0, top, n)
    stats = [
        StatColumn(1, "int", rng.integers(-(2**40), top, n), rng.random(n) < 0.7),
        StatColumn(2**33, "ref", rng.integers(1, top, n), rng.random(n) < 0.5),
        StatColumn(3, "double", rng.standard_normal(n) * 1e9, rng.random(n) < 0.3),
    ]
    line = xp.XLine(id=5, name="t")
    line.MergeFromString(encode_line_events(mid, off, dur, stats))
    want = _reference(mid, off, dur, stats)
    want.id, want.name = 5, "t"
    assert line == want


def test_varint_sizes_and_empty_input() -> None:
    values = np.array([0, 127, 128, 16383, 16384, 2**63, 2**64 - 1], dtype=np.uint64)
    assert varint_sizes(values).tolist() == [1, 1, 2, 2, 3, 10, 10]
    empty = np.zeros(0, dtype=np.int64)
    assert encode_line_events(empty, empty, empty, []) == b""
