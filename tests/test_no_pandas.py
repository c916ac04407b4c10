"""pandas stays out of a capture's processes (pyarrow's first ``pa.array`` imports it only to ask whether the input
is a pandas object: +43 MB of RSS and ~0.7 s of CPU in the script's process, taken by a capture thread holding the
GIL).  The script's own tables are built from buffers (``tpudiag.arrow_columns``), the same tables ``pa.table``
builds; tpudiag's own window analyst reports pandas as not installed (``tpudiag.no_pandas``)."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from tests.conftest import run_tpudiag
from tpudiag import arrow_columns
from tpudiag.longrun import analyst
from tpudiag.model import PulseStep, arrow_schema

pytest.importorskip("pandas")  # (without pandas there is nothing to keep out)

SCHEMA = pa.schema([("i", pa.int64()), ("f", pa.float64()), ("b", pa.bool_()), ("s", pa.string())])


FULL = {
    "i": [1, None, -(2**63), 2**63 - 1],
    "f": [1.5, None, -0.0, 3],
    "b": [True, None, False, True],
    "s": ["x", None, "", "héllo ✓"],
}


@pytest.mark.parametrize(
    "columns",
    [
        FULL,
        {"i": [], "f": [], "b": [], "s": []},
        {"i": [None, None], "f": [None, None], "b": [None, None], "s": [None, None]},
        {"i": [7] * 9, "f": [0.25] * 9, "b": [False] * 9, "s": ["a" * 300] * 9},
    ],
)
def test_tables_from_buffers_equal_pyarrows_own(columns: dict[str, list[Any]]) -> None:
    built = arrow_columns.table(columns, SCHEMA)
    built.validate(full=True)
    assert built.equals(pa.table(columns, schema=SCHEMA))


def test_nan_is_a_value_and_none_a_null() -> None:
    built = arrow_columns.column([float("nan"), None], pa.float64())
    assert built.null_count == 1 and math.isnan(built[0].as_py())


@pytest.mark.parametrize(
    ("kind", "values"),
    [
        (pa.int64(), [1, 2.5]),  # a float in an int column: pyarrow refuses it
        (pa.int64(), [1, True]),
        (pa.int64(), [2**64]),  # out of range
        (pa.float64(), [1.0, "x"]),
        (pa.bool_(), [True, 1]),
        (pa.string(), ["ok", "\ud800"]),  # a lone surrogate
        (pa.string(), ["ok", 3]),
        (pa.string(), ["ok", ["a list"]]),  # unhashable
    ],
)
def test_anything_else_is_converted_or_refused_as_pyarrow_does(kind: pa.DataType, values: list[Any]) -> None:
    try:
        expected: Any = pa.array(values, type=kind)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as err:
        expected = type(err)
    try:
        got: Any = arrow_columns.column(values, kind)
    except (pa.ArrowException, TypeError, ValueError, OverflowError) as err:
        got = type(err)
    if isinstance(expected, pa.Array):
        assert isinstance(got, pa.Array) and got.equals(expected)
    else:
        assert got is expected


def test_string_columns_of_repeated_and_distinct_values_equal_pyarrows_own() -> None:
    """String columns are encoded once per distinct value: every mix of repeats, nulls and sizes."""
    rng = random.Random(0)
    pool = ["", "a", "é漢字 ✓", "[[32, 128]]", None, "x" * 70]
    for _ in range(500):
        kinds = pool[: rng.randrange(1, len(pool) + 1)]
        values = [rng.choice(kinds) for _ in range(rng.choice([0, 1, 2, 9, 300]))]
        built = arrow_columns.column(values, pa.string())
        built.validate(full=True)
        assert built.equals(pa.array(values, type=pa.string())), values


def test_int64_arrays_from_numpy_equal_pyarrows_own() -> None:
    values = np.array([5, -(2**63), 2**63 - 1, 0], dtype=np.int64)
    valid = np.array([True, False, True, True])
    built = arrow_columns.int64_array(values, valid)
    built.validate(full=True)
    assert built.equals(pa.array([5, None, 2**63 - 1, 0], type=pa.int64()))
    assert arrow_columns.int64_array(values).equals(pa.array(values.tolist(), type=pa.int64()))


def _pulse_rows(records: list[tuple[Any, ...]], nonfinite: dict[int, bool], compiled: dict[int, Any]) -> list[Any]:
    """The pulse rows of ``records`` computed one at a time, as the writer did before it built columns."""
    rows = []
    for step, start, end, prev, own, shapes, window_id, figures in records:
        if start is None:
            start, gap = (prev if prev is not None else end), None
        else:
            gap = start - prev if prev is not None else None
        dur = end - start
        counts = compiled.get(step, (0, 0, 0))
        rows.append({"run_id": "run-é1", "step": step, "start_ns": start + 1000, "dur_ns": dur, "gap_ns": gap,
                     "own_ns": min(own, dur + (gap or 0)), "rank": 3, "shapes": shapes, "compiles": counts[0],
                     "recompiles": counts[1], "graph_breaks": counts[2], "nonfinite": nonfinite.get(step),
                     "window_id": window_id, "figures": json.dumps(figures) if figures else None})  # fmt: skip
    return rows


def test_the_pulse_writers_columns_are_its_records_row_by_row() -> None:
    """The writer builds a hand-off's table by column (numpy for the clocks): the same rows as record by record,
    with steps without a start or a previous end, compile counts and gradient checks joined by step, window ids
    and figures."""
    from types import SimpleNamespace

    from tpudiag.collectors.pulse import PulseRecorder

    writer = PulseRecorder.__new__(PulseRecorder)  # (only what ``_table`` reads: no capture, no thread)
    writer._epoch_offset, writer._ctx, writer.rank = 1000, SimpleNamespace(run_id="run-é1"), 3
    rng = random.Random(1)
    for _ in range(200):
        n, t, first = rng.choice([1, 2, 7, 120]), 10**12, rng.randrange(1000)
        records = []
        for i in range(n):
            start = None if rng.random() < 0.1 else t + rng.randrange(100)
            prev = None if rng.random() < 0.05 else t - rng.randrange(1000)
            end = (start or t) + rng.randrange(1, 10**6)
            figures = rng.choice([None, {}, {"memory_allocated": 1.5, "reserved": None}])
            records.append((first + i, start, end, prev, rng.choice([0, 10, 10**9]), rng.choice(["", "[[8, 16]]"]),
                            rng.choice([None, 0, 4]), figures))  # fmt: skip
            t = end + 5
        compiled = {first + rng.randrange(n): (1, rng.randrange(2), 0) for _ in range(rng.randrange(3))}
        nonfinite = {first + rng.randrange(n): rng.random() < 0.5 for _ in range(rng.randrange(3))}
        compiled[first + n + 5] = (1, 0, 0)  # (a step not in this hand-off: not joined)
        table = writer._table(records, nonfinite, compiled)
        table.validate(full=True)
        assert table.schema == arrow_schema(PulseStep)
        assert table.to_pylist() == _pulse_rows(records, nonfinite, compiled)
    assert writer._table([]).num_rows == 0


SCRIPT = textwrap.dedent(
    """
    import atexit
    import sys

    import torch
    from torch import nn

    import tpudiag

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    double = torch.compile(lambda t: t * 2, backend="eager")
    for step in range(300):
        if step == 150:
            tpudiag.trigger(steps=2)
        opt.zero_grad()
        double(model(torch.randn(8, 16))).mean().backward()
        opt.step()
    # At exit: after the capture has written its last tables (the numerics collector's rows come at the end).
    atexit.register(lambda: print("pandas" in sys.modules))
    """
)


def test_a_capture_imports_no_pandas_into_the_script(tmp_path: Path, db: Path) -> None:
    script = tmp_path / "loop.py"
    script.write_text(SCRIPT)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert plain.returncode == 0, plain.stderr
    proc = run_tpudiag("capture", "--db", str(db), str(script), cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == plain.stdout == "False\n"  # every collector wrote its tables, the pulse every step's
    rep = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    data = json.loads(rep.stdout)
    assert data["pulse"]["steps"] == 300
    assert {"first_steps", "manual"} <= {w["reason"] for w in data["windows"]}


def test_the_window_analyst_imports_no_pandas(tmp_path: Path) -> None:
    """The real analyst process on a real profiler window: its job done, its tables spooled, and no pandas among
    the modules it imported (``-X importtime`` lists each)."""
    import torch

    trace = tmp_path / "trace"
    trace.mkdir()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            torch.nn.functional.linear(torch.randn(8, 16), torch.randn(4, 16)).sum()
    kineto = trace / "kineto-000.json"
    prof.export_chrome_trace(str(kineto))
    job = {"window_id": 0, "path": str(kineto), "first_event_id": 0, "first_step": 0, "last_step": 2,
           "reason": "first_steps", "start_ns": 0, "end_ns": 1, "run_dir": str(tmp_path)}  # fmt: skip
    analyst.write_job(trace, job)
    (trace / analyst.JOBS / analyst.STOP).touch()
    env = {k: v for k, v in os.environ.items() if k not in ("TPUDIAG_WITH_PANDAS", "TPUDIAG_IMPORT_WITH_PANDAS")}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tpudiag.longrun.analyst", str(tmp_path), "r1", str(trace),
         str(os.getpid())],
        capture_output=True, text=True, cwd=trace, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not analyst.pending_jobs(trace)
    assert list((tmp_path / "spool" / "trace_events").glob("*.parquet"))
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time")}
    assert "pyarrow" in imported, sorted(imported)
    # (A refused import is listed too, as "pandas" alone: a real one loads its submodules.)
    assert not [name for name in imported if name.startswith("pandas.")]


def test_the_pulse_table_is_built_without_pandas() -> None:
    """The pulse writer's table is the one pyarrow would build from the same lists."""
    schema = arrow_schema(PulseStep)
    row = {f.name: [None] for f in schema}
    row.update(step=[3], start_ns=[10], dur_ns=[5], run_id=["r"], rank=[0], shapes=["[[8, 16]]"], nonfinite=[False])
    assert arrow_columns.table(row, schema).equals(pa.table(row, schema=schema))
