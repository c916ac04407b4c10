"""A distributed run built from hand-written rank shards: merge into the store, report section, dashboard page."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from tests.factories import make_run
from tpudiag.distributed import merge, report_section
from tpudiag.distributed.records import Fingerprint, RankInfo
from tpudiag.distributed.shards import ShardSpool
from tpudiag.model import OpDiff, OpRecord, Step, TraceEvent, arrow_schema, register_table
from tpudiag.store import Store

MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"
STEPS = 6


def _collectives(run_id: str, rank: int, mismatch_at: int | None = None) -> pa.Table:
    n = STEPS
    cols = {
        "run_id": [run_id] * n,
        "event_id": list(range(n)),
        "source": ["kineto"] * n,
        "process": ["p"] * n,
        "thread": ["gloo"] * n,
        "name": ["gloo:all_reduce"] * n,
        "category": ["user_annotation"] * n,
        "start_ns": [s * 10_000_000 for s in range(n)],
        "dur_ns": [200_000 if rank == 2 else 6_000_000] * n,  # rank 2 arrives last: it waits least
        "self_ns": [1] * n,
        "shapes": ["[[6, 6]]" if (s == mismatch_at and rank == 1) else "[[36]]" for s in range(n)],
        "dtypes": ['["float"]'] * n,
    }
    schema = arrow_schema(TraceEvent)
    return pa.table({f.name: cols.get(f.name, pa.nulls(n, f.type)) for f in schema}, schema=schema)


def build(store: Store, lost_rank: bool = False, mismatch_at: int | None = None, odd_rank: int | None = None) -> str:
    run = make_run(artifacts_dir=None)
    run_dir = store.run_dir(run.id)
    root = run_dir / "shards"
    for rank in range(3):
        spool = ShardSpool(root, run_dir / "staging", run.id, rank, 0)
        spool.write_table("trace_events", _collectives(run.id, rank, mismatch_at))
        n_steps = STEPS + (rank == odd_rank)  # an odd count: the median is the middle step, not a mean of two
        spool.write_records(
            Step, [Step(run.id, s, s * 10, 9_000_000 + rank + (s * 7 % 5) * 1_001, "optimizer") for s in range(n_steps)]
        )
        spool.write_records(
            Fingerprint,
            [Fingerprint(run.id, rank, s, "param", "x" if rank == 1 and s >= 4 else f"p{s}") for s in range(STEPS)],
        )
        # Numerics of each rank: rank 2 has one failing output.
        spool.write_records(OpRecord, [OpRecord(run.id, 0, "aten::mm", checked=True)])
        verdict = "fail" if rank == 2 else "pass"
        spool.write_records(OpDiff, [OpDiff(run.id, 0, 0, verdict), OpDiff(run.id, 0, 1, "skip")])
        if not (lost_rank and rank == 1):
            spool.write_records(
                RankInfo,
                [RankInfo(run.id, rank, world_size=3, host="h", pid=100 + rank, backend="gloo", status="ok")],
            )
    store.put_run(run)
    with store.writer() as w:
        final = merge.finish(store, run, run_dir, con=w)
        store.put_run(final, con=w)
    return run.id


def test_merge_and_section(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    rid = build(store)
    section = report_section.build_section(store, {"id": rid})
    assert section is not None
    assert section["world_size"] == 3 and section["backend"] == "gloo"
    assert [r["steps"] for r in section["ranks"]] == [STEPS] * 3
    assert [s["rank"] for s in section["stragglers"]] == [2]
    assert section["rank_divergence"]["ranks"][0]["rank"] == 1
    assert section["rank_divergence"]["ranks"][0]["from_step"] == 4
    # The run's own tables hold every rank's events, ids unique: what report/dashboard/exports read.
    with store.reader() as con:
        rows = con.execute(
            "SELECT rank, count(*), count(DISTINCT event_id) FROM trace_events WHERE run_id = ? GROUP BY rank "
            "ORDER BY rank",
            [rid],
        ).fetchall()
    assert rows == [(0, STEPS, STEPS), (1, STEPS, STEPS), (2, STEPS, STEPS)]
    assert [r["numerics_failures"] for r in section["ranks"]] == [0, 0, 1]
    with store.reader() as con:
        ops = con.execute("SELECT count(*) FROM ops WHERE run_id = ?", [rid]).fetchall()
    assert ops == [(1,)]  # the lowest rank's numerics only: the numerics section reads as one rank's
    text = "\n".join(report_section.render_section(section))
    assert "rank 2: chronic, last at 6/6 collectives" in text
    assert "only rank 1 diverges from the others, from step 4 (params)" in text
    # Merging again (a second finish) replaces, never duplicates.
    with store.writer() as w:
        merge.finish(store, make_run(id=rid), store.run_dir(rid), con=w)
    again = report_section.build_section(store, {"id": rid})
    assert again is not None and len(again["ranks"]) == 3
    with store.reader() as con:  # the run's own tables too (a second node of a multi-node job merges again)
        counts = [
            con.execute(f"SELECT count(*) FROM {t} WHERE run_id = ?", [rid]).fetchone()
            for t in ("trace_events", "steps", "ops")
        ]
    assert counts == [(3 * STEPS,), (3 * STEPS,), (1,)]


def test_rank_without_a_record_is_lost_and_fails_the_run(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    rid = build(store, lost_rank=True)
    section = report_section.build_section(store, {"id": rid})
    assert section is not None
    assert {r["rank"]: r["status"] for r in section["ranks"]} == {0: "ok", 1: "lost", 2: "ok"}
    assert section["first_failure"]["rank"] == 1
    with store.reader() as con:
        status, notes = con.execute("SELECT status, notes FROM runs WHERE id = ?", [rid]).fetchall()[0]
    assert status == "failed"
    assert any("rank 1 failed first" in n for n in json.loads(notes))


def test_single_process_run_has_no_section(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    run = make_run()
    store.put_run(run)
    assert report_section.build_section(store, {"id": run.id}) is None


@pytest.mark.slow
def test_ranks_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = Store(tmp_path / "s.duckdb")
    rid = build(store)
    monkeypatch.setenv("TPUDIAG_DB", str(store.path))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    at.run()
    at.selectbox(key="run").set_value(rid)
    at.switch_page("views/ranks.py").run()
    assert not at.exception, at.exception
    m = {x.label: x.value for x in at.metric}
    assert m["World size"] == "3" and m["Stragglers"] == "1" and m["First failure"] == "–"
    tables = [d.value.to_dict("records") for d in at.dataframe]
    ranks = next(t for t in tables if t and "collective_s" in t[0])
    assert [r["rank"] for r in ranks] == [0, 1, 2]
    stragglers = next(t for t in tables if t and "straggler rank" in t[0])
    assert stragglers[0]["straggler rank"] == 2 and stragglers[0]["kind"] == "chronic"
    texts = [t.value for t in at.text]
    assert any("only rank 1 diverges" in t for t in texts)


def test_sql_aggregates_agree_with_the_pure_functions(tmp_path: Path) -> None:
    """The report aggregates collectives in SQL; ``analysis`` is the specification it must match."""
    from tpudiag.distributed import analysis
    from tpudiag.store import distributed_queries as q

    store = Store(tmp_path / "s.duckdb")
    rid = build(store, mismatch_at=4)
    with store.reader() as con:
        everything = q.collectives(con, rid, 0)
        expected_mismatch = analysis.collective_mismatch(everything)
        got_mismatch = analysis.collective_mismatch(q.first_mismatch(con, rid, 0), all_ranks=[0, 1, 2])
        count = analysis.paired_count([STEPS] * 3, expected_mismatch)
        sql_late = q.lateness(con, rid, 0, count)
        waits = q.waits_before(con, rid, 0, count)
    assert expected_mismatch is not None and expected_mismatch["seq"] == 4
    assert got_mismatch == expected_mismatch
    assert count == 4
    assert sql_late == analysis.lateness(everything, count)
    assert analysis.stragglers_from(sql_late, count, waits) == analysis.stragglers(everything)
    section = report_section.build_section(store, {"id": rid})
    assert section is not None and section["collective_mismatch"]["ranks"] == [0, 1, 2]
    assert section["stragglers"][0]["collectives"] == 4


def test_per_rank_sql_agrees_with_the_pure_functions(tmp_path: Path) -> None:
    """Step spread and rank divergence come from SQL (per-rank rows, disagreeing cells only): same as ``analysis``
    over every step and fingerprint."""
    from tpudiag.distributed import analysis
    from tpudiag.distributed.records import Fingerprint
    from tpudiag.store import distributed_queries as q

    store = Store(tmp_path / "s.duckdb")
    rid = build(store, odd_rank=2)
    with store.reader() as con:
        rows = con.execute(
            "SELECT rank, list(dur_ns ORDER BY step) FROM dist_steps WHERE run_id = ? GROUP BY rank", [rid]
        ).fetchall()
        every = con.execute("SELECT * FROM dist_fingerprints WHERE run_id = ? ORDER BY step, kind, rank", [rid])
        cols = [d[0] for d in every.description or []]
        prints = [Fingerprint(**dict(zip(cols, r, strict=True))) for r in every.fetchall()]
        spread = q.step_spread(con, rid, 0)
        divergent = q.divergent_fingerprints(con, rid, 0)
        seen = q.fingerprint_ranks(con, rid, 0)
    assert spread == analysis.step_spread({int(r): [int(d) for d in durs] for r, durs in rows})
    assert spread[2]["steps"] == STEPS + 1 and spread[0]["steps"] == STEPS
    assert analysis.rank_divergence(divergent, all_ranks=seen) == analysis.rank_divergence(prints)
    assert len(divergent) < len(prints)  # the cells where every rank agrees (steps 0-3) stay in the database
    assert analysis.rank_divergence(divergent, all_ranks=seen)["reference_ranks"] == [0, 2]  # type: ignore[index]


@dataclass(frozen=True)
class MemorySample:
    """A collector-declared record type (as a plugin's ``Collector.tables`` would list it)."""

    TABLE: ClassVar[str] = "test_memory_samples"

    run_id: str
    step: int
    bytes_in_use: int


def test_a_collector_declared_table_is_sharded_and_merged_into_the_run(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    run = make_run(artifacts_dir=None)
    run_dir = store.run_dir(run.id)
    unregistered = ShardSpool(run_dir / "shards", run_dir / "staging", run.id, 0, 0)
    with pytest.raises(ValueError, match="unknown table 'test_memory_samples'"):
        unregistered.write_records(MemorySample, [MemorySample(run.id, 0, 1)])
    register_table(MemorySample)
    for attempt in (0, 1):  # a torchelastic restart: the run's table keeps the last attempt, every rank
        for rank in range(2):
            spool = ShardSpool(run_dir / "shards", run_dir / "staging", run.id, rank, attempt)
            spool.write_records(MemorySample, [MemorySample(run.id, s, 1000 * (attempt + 1) + rank) for s in range(3)])
            spool.write_records(RankInfo, [RankInfo(run.id, rank, restart=attempt, world_size=2, status="ok")])
    store.put_run(run)
    for _ in range(2):  # a second merge (another node finishing later) replaces, never duplicates
        with store.writer() as w:
            store.put_run(merge.finish(store, run, run_dir, con=w), con=w)
    with store.reader() as con:
        rows = con.execute(
            "SELECT rank, count(*), min(bytes_in_use) FROM test_memory_samples WHERE run_id = ? GROUP BY rank "
            "ORDER BY rank",
            [run.id],
        ).fetchall()
    assert rows == [(0, 3, 2000), (1, 3, 2001)]
    with pytest.raises(ValueError, match="taken"):
        register_table(
            dataclass(frozen=True)(type("Clash", (), {"TABLE": "steps", "__annotations__": {"run_id": str}}))
        )
