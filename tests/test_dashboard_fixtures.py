"""Hand-built runs for the dashboard tests, written through the real spool + ingest path into a DuckDB file.

``rich_store`` holds three runs:
- ``base``: host trace (cpu_op events in a module tree, 4 steps), numerics with one originator and one
  propagator, compile events (compiles, recompiles with reasons, a graph break, cache hits and misses);
- ``cand``: the same model slower in ``aten::mm``, with a device trace (kernels), clean numerics, no compile
  events;
- ``hostile``: a run whose name, ops and modules are script/HTML/SQL fragments.
The expected numbers in tests are computed from these records, never typed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.factories import make_event, make_run, make_step, store_with
from tpudiag.model import CompileEvent, OpDiff, OpRecord, Run, Step, TraceEvent
from tpudiag.store import Store

HOSTILE = "<script>alert('x')</script>\"; DROP TABLE runs; --"
MODULES = ("encoder.layer0.attn", "encoder.layer0.mlp", "encoder.layer1.attn", "head")
# op -> self ns per call, per module it runs in (base run)
OP_TIMES = {"aten::mm": 5_000, "aten::softmax": 2_000, "aten::gelu": 1_500, "aten::add": 300}
STEP_NS = 1_000_000


@dataclass
class BuiltRun:
    run: Run
    events: list[TraceEvent] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    ops: list[OpRecord] = field(default_factory=list)
    diffs: list[OpDiff] = field(default_factory=list)
    compiles: list[CompileEvent] = field(default_factory=list)

    def write(self, store: Store) -> None:
        tables: dict[type[Any], list[Any]] = {}
        for cls, rows in (
            (TraceEvent, self.events),
            (Step, self.steps),
            (OpRecord, self.ops),
            (OpDiff, self.diffs),
            (CompileEvent, self.compiles),
        ):
            if rows:
                tables[cls] = rows
        store_with(store, self.run, tables)


def trace_run(
    run: Run,
    mm_scale: float = 1.0,
    device: bool = False,
    steps: int = 4,
    op_names: dict[str, str] | None = None,
    modules: tuple[str, ...] = MODULES,
) -> BuiltRun:
    """A host trace: per step, each module runs each op once (mm ``mm_scale`` slower); optional kernels."""
    built = BuiltRun(run)
    op_names = op_names or {}
    eid = 0
    t0 = 1_700_000_000_000_000_000
    for step in range(steps):
        start = t0 + step * STEP_NS
        built.steps.append(make_step(run.id, step, start, STEP_NS))
        t = start + 1_000
        for mi, module in enumerate(modules):
            for op, ns in OP_TIMES.items():
                dur = int(ns * (mm_scale if op == "aten::mm" else 1.0)) + step * 10 + mi
                built.events.append(
                    make_event(
                        run.id,
                        eid,
                        op_names.get(op, op),
                        t,
                        dur,
                        module=module,
                        step=step,
                        phase="forward" if mi % 2 == 0 else "backward",
                        shapes=json.dumps([[8, 16], [16, 16]]),
                        dtypes='["float","float"]',
                        source_loc=f"model.py:{10 + mi}",
                    )
                )
                eid += 1
                t += dur + 100
                if device:
                    built.events.append(
                        make_event(
                            run.id,
                            eid,
                            f"kernel_{op.split('::')[-1]}",
                            t,
                            dur // 2,
                            category="kernel",
                            on_device=True,
                            process="gpu0",
                            thread="stream 7",
                            step=step,
                        )
                    )
                    eid += 1
    return built


def with_numerics(
    built: BuiltRun,
    fail_at: int | None,
    n_ops: int = 40,
    op_name: str = "aten::tanh",
    module: str = "encoder.layer0.mlp",
) -> BuiltRun:
    """n_ops checked ops (a few skipped); at ``fail_at`` an originator, two ops later a propagator."""
    rid = built.run.id
    for seq in range(n_ops):
        skipped = seq % 10 == 3
        op = op_name if seq == fail_at else ("aten::normal_" if skipped else "aten::mm")
        mod = module if seq == fail_at else MODULES[seq % len(MODULES)]
        built.ops.append(
            OpRecord(
                run_id=rid,
                seq=seq,
                op=op,
                module=mod,
                phase="forward",
                source_loc=f"model.py:{100 + seq}",
                dtypes='["float32"]',
                shapes="[[8, 16]]",
                device="cpu",
                checked=not skipped,
                skip_reason="random" if skipped else None,
                step=seq // 10,
            )
        )
        if skipped:
            continue
        error = 1.0 + (seq % 4) * 0.5
        verdict, role = "pass", None
        if fail_at is not None and seq == fail_at:
            error, verdict, role = 25_000.0, "fail", "originator"
        elif fail_at is not None and seq == fail_at + 2:
            error, verdict, role = 900.0, "fail", "propagator"
        built.diffs.append(
            OpDiff(
                run_id=rid,
                seq=seq,
                output_index=0,
                verdict=verdict,
                role=role,
                dtype="float32",
                numel=128,
                max_abs=error * 1e-7,
                scaled_error=error,
                max_rel=error * 1e-6,
                cosine=1.0,
                max_ulp=error,
            )
        )
    return built


def with_compiles(built: BuiltRun) -> BuiltRun:
    rid = built.run.id
    t = 1_700_000_000_000_000_000
    rows: list[dict[str, Any]] = [
        {"kind": "compile", "function": "forward", "file": "model.py", "line": 20, "duration_s": 4.0},
        {
            "kind": "recompile",
            "function": "forward",
            "file": "model.py",
            "line": 20,
            "duration_s": 2.5,
            "reason": "tensor 'x' size mismatch at index 0. expected 8, actual 16",
        },
        {
            "kind": "recompile",
            "function": "forward",
            "file": "model.py",
            "line": 20,
            "duration_s": 2.0,
            "reason": "tensor 'x' size mismatch at index 0. expected 16, actual 32",
        },
        {"kind": "compile", "function": "loss_fn", "file": "train.py", "line": 5, "duration_s": 1.0},
        {
            "kind": "recompile",
            "function": "loss_fn",
            "file": "train.py",
            "line": 5,
            "duration_s": 0.5,
            "reason": "___check_type_id(y)",
        },
        {
            "kind": "graph_break",
            "function": "forward",
            "file": "model.py",
            "line": 31,
            "reason": "call_function print",
        },
        {"kind": "cache", "cache_tier": "inductor_fx_graph", "cache_hit": False},
        {"kind": "cache", "cache_tier": "inductor_fx_graph", "cache_hit": True},
        {"kind": "cache", "cache_tier": "inductor_fx_graph", "cache_hit": True},
        {"kind": "cache", "cache_tier": "aotautograd", "cache_hit": False},
    ]
    for seq, row in enumerate(rows):
        built.compiles.append(CompileEvent(run_id=rid, seq=seq, ts_ns=t + seq * 500_000_000, **row))
    return built


@dataclass
class RichStore:
    store: Store
    base: BuiltRun
    cand: BuiltRun
    hostile: BuiltRun


def build_rich_store(path: Path) -> RichStore:
    store = Store(path)
    base = with_compiles(with_numerics(trace_run(make_run(name="base", started_at=1_700_000_100.0)), fail_at=17))
    cand = with_numerics(
        trace_run(make_run(name="cand", started_at=1_700_000_200.0), mm_scale=3.0, device=True), fail_at=None
    )
    hostile = with_numerics(
        trace_run(
            make_run(name=HOSTILE, started_at=1_700_000_300.0, script=HOSTILE),
            op_names={"aten::mm": "<img src=x onerror=alert(1)>"},
            modules=("<b>bold</b>.x",),
        ),
        fail_at=5,
        op_name="<script>op</script>",
        module="'; DELETE FROM ops; --",
    )
    for built in (base, cand, hostile):
        built.write(store)
    return RichStore(store, base, cand, hostile)


def expected_top_ops(built: BuiltRun, device: bool = False) -> list[tuple[str, int, int]]:
    """(name, calls, self ns) by self time, computed from the records the way the page should."""
    totals: dict[str, list[int]] = {}
    for e in built.events:
        if e.on_device != device:
            continue
        entry = totals.setdefault(e.name, [0, 0])
        entry[0] += 1
        entry[1] += e.self_ns
    return sorted(((n, c, t) for n, (c, t) in totals.items()), key=lambda x: (-x[2], x[0]))


def test_rich_store_lands(tmp_path: Path) -> None:
    """The builder itself: every record written is readable back through the store."""
    from tpudiag.store import queries

    rich = build_rich_store(tmp_path / "store.duckdb")
    runs = queries.list_runs(rich.store)
    assert [r["name"] for r in runs] == [HOSTILE, "cand", "base"]
    counts = queries.trace_counts(rich.store, rich.base.run.id)
    assert counts == {"cpu_op": len(rich.base.events)}
