"""Event-tree analysis (vectorised) against the plain stack walk, and the fast Kineto splitter against json."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tpudiag.analysis.tree import attribute_modules, nest, nest_arrays
from tpudiag.traces import kineto


def _stack_walk(codes: list[int], s: list[int], d: list[int]) -> tuple[list[int], list[int]]:
    """Reference: per thread, in (start, -dur, index) order, pop what ends before the event (zero-length at an end
    stays inside), the top of the stack is the parent."""
    n = len(s)
    parent, depth = [-1] * n, [0] * n
    stack: list[int] = []
    current = None
    for i in sorted(range(n), key=lambda i: (codes[i], s[i], -d[i], i)):
        if codes[i] != current:
            stack, current = [], codes[i]
        while stack and s[stack[-1]] + d[stack[-1]] <= s[i] and d[i] > 0:
            stack.pop()
        while stack and s[stack[-1]] + d[stack[-1]] < s[i] + d[i]:
            stack.pop()
        if stack:
            parent[i], depth[i] = stack[-1], depth[stack[-1]] + 1
        stack.append(i)
    return parent, depth


events = st.lists(
    st.tuples(st.integers(0, 2), st.integers(0, 40), st.sampled_from([0, 0, 1, 2, 3, 7, 20, 40])), max_size=60
)


@settings(max_examples=300, deadline=None)
@given(events)
def test_nesting_equals_the_stack_walk(evs: list[tuple[int, int, int]]) -> None:
    codes, s, d = ([e[k] for e in evs] for k in range(3))
    before = (list(codes), list(s), list(d))
    parent, depth, self_ns = nest_arrays(np.array(codes, np.int64), np.array(s, np.int64), np.array(d, np.int64))
    want_parent, want_depth = _stack_walk(codes, s, d)
    assert parent.tolist() == want_parent and depth.tolist() == want_depth
    child = [sum(d[j] for j in range(len(s)) if want_parent[j] == i) for i in range(len(s))]
    assert self_ns.tolist() == [max(d[i] - child[i], 0) for i in range(len(s))]
    assert (codes, s, d) == before  # inputs untouched
    # times far apart (epoch-sized spans on many threads) take the path that ranks the ends instead of offsetting
    scale = 1 << 55  # ends up to 80 * 2**55: three threads of such spans do not fit 62 bits
    far = nest_arrays(np.array(codes, np.int64), np.array(s, np.int64) * scale, np.array(d, np.int64) * scale)
    assert far[0].tolist() == want_parent and far[1].tolist() == want_depth


def test_empty_in_empty_out() -> None:
    assert nest([], [], []).parent == []
    attr = attribute_modules([], [], [], [], [])
    assert len(attr.module) == len(attr.phase) == len(attr.source_loc) == 0


def test_backward_ops_take_the_module_of_their_forward_op() -> None:
    names = ["module::net.fc", "aten::addmm", "autograd::engine::evaluate_function: AddmmBackward0", "aten::mm"]
    threads = [("p", "1"), ("p", "1"), ("p", "2"), ("p", "2")]
    starts, durs = [0, 1, 100, 101], [10, 5, 10, 5]
    tree = nest(threads, starts, durs)
    attr = attribute_modules(names, ["p"] * 4, starts, [None, 7, 7, None], tree.parent, {"net.fc": "m.py:3"})
    assert attr.module.to_pylist() == ["net.fc"] * 4
    assert attr.phase.to_pylist() == ["forward", "forward", "backward", "backward"]
    assert attr.source_loc.to_pylist() == ["m.py:3"] * 4


def _write(path: Path, doc: Any, indent: int | None) -> None:
    path.write_bytes(gzip.compress(json.dumps(doc, indent=indent).encode()))


def test_fast_split_survives_cuts_inside_strings_and_nested_objects(tmp_path: Path, monkeypatch: Any) -> None:
    """Names and args full of '},' and lists of objects; metadata after traceEvents; tiny chunks."""
    evs: list[dict[str, Any]] = []
    for k in range(400):
        evs.append(
            {
                "ph": "X",
                "cat": "cpu_op",
                "name": f'op}},{{"x": [{k}]}}, "',
                "pid": 1,
                "tid": k % 3,
                "ts": k * 10.5,
                "dur": 3.25,
                "args": {
                    "l": [{"a": 1}, {"b": "},{"}],
                    "External id": k,
                    "Input Dims": [[k, 2], []],
                    "Input type": ["float", ""],
                },
            }
        )
        evs.append({"ph": "i", "name": "mark", "pid": 1, "tid": 0, "ts": k * 10.0, "args": {"s": "}, {"}})
    doc = {
        "schemaVersion": 1,
        "traceEvents": evs,
        "deviceProperties": [{"id": 0}, {"id": 1}],
        "baseTimeNanoseconds": 1000,
    }
    for indent in (None, 2):
        path = tmp_path / f"t{indent}.json.gz"
        _write(path, doc, indent)
        for chunk in (1 << 20, 301, 37):
            monkeypatch.setattr(kineto, "READ_CHUNK", chunk)
            trace = kineto.load(path)
            cols = trace.columns
            xs = [e for e in evs if e["ph"] == "X"]
            assert cols.column("name").to_pylist() == [e["name"] for e in xs]
            assert cols.column("start_ns").to_pylist() == [1000 + round(e["ts"] * 1000) for e in xs]
            assert cols.column("external_id").to_pylist() == list(range(400))
            assert cols.column("shapes").to_pylist() == [
                json.dumps(e["args"]["Input Dims"], separators=(",", ":")) for e in xs
            ]
            assert [json.loads(a) for a in cols.column("args").to_pylist()] == [e["args"] for e in xs]
            assert trace.metadata["deviceProperties"] == [{"id": 0}, {"id": 1}]
            # the two-process read meets the same bad cuts (its worker cannot re-split) and falls back: same trace
            monkeypatch.setattr(kineto, "PARALLEL_MIN_BYTES", 0)
            both = kineto.load(path, parallel=True)
            assert both.columns.to_pylist() == cols.to_pylist()
            assert both.metadata == trace.metadata
