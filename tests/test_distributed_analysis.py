"""The cross-rank analyses on hand-built records (no torch): contracts, and each question answered."""

from __future__ import annotations

import copy
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

from tpudiag.distributed import analysis
from tpudiag.distributed.records import Collective, Fingerprint, RankInfo
from tpudiag.distributed.shards import ShardSpool, shard_schema, table_glob
from tpudiag.model import CompileEvent, Step, records_to_arrow


def coll(rank: int, seq: int, dur_ms: float, op: str = "all_reduce", shapes: str = "[[36]]") -> Collective:
    return Collective("r", rank, seq, op, shapes=shapes, dtypes='["float"]', dur_ns=int(dur_ms * 1e6))


def fp(rank: int, step: int, kind: str, digest: str) -> Fingerprint:
    return Fingerprint("r", rank, step, kind, digest, abs_sum=1.0)


def compile_event(rank: int, seq: int, kind: str, shapes: str = "[[4]]") -> CompileEvent:
    return CompileEvent("r", seq, kind, rank=rank, function="forward", shapes=shapes)


@pytest.mark.parametrize(
    "fn",
    [analysis.stragglers, analysis.collective_mismatch, analysis.rank_divergence, analysis.compile_divergence],
)
def test_empty_in_nothing_out(fn: object) -> None:
    assert fn([]) in (None, [])  # type: ignore[operator]


def test_inputs_are_not_mutated() -> None:
    records = [coll(r, s, 5 if r == 2 else 50) for r in range(3) for s in range(4)]
    before = copy.deepcopy(records)
    analysis.stragglers(records)
    analysis.collective_mismatch(records)
    assert records == before


def test_straggler_is_the_rank_that_waits_least() -> None:
    # Rank 2 is late at every collective: it waits 2 ms while the others wait 50 ms for it.
    records = [coll(r, s, 2 if r == 2 else 50 + r) for r in range(4) for s in range(6)]
    out = analysis.stragglers(records)
    assert [s["rank"] for s in out] == [2]
    assert out[0]["kind"] == "chronic" and out[0]["late_at"] == 6 and out[0]["collectives"] == 6
    assert out[0]["others_waited_s"] == pytest.approx(6 * 0.049, abs=1e-3)


def test_one_late_collective_is_one_off_and_noise_names_nobody() -> None:
    records = [coll(r, s, 10 + (s + r) % 3 * 0.01) for r in range(3) for s in range(5)]
    assert analysis.stragglers(records) == []  # equal waits: nobody is late
    records[1 * 5 + 2] = coll(1, 2, 0.5)  # rank 1 late once
    out = analysis.stragglers(records)
    assert [(s["rank"], s["kind"], s["worst_seq"]) for s in out] == [(1, "one-off", 2)]


def test_mismatch_names_both_ranks_and_a_missing_rank() -> None:
    records = [coll(0, 0, 1), coll(1, 0, 1), coll(0, 1, 1, shapes="[[2, 3]]"), coll(1, 1, 1, shapes="[[3, 2]]")]
    m = analysis.collective_mismatch(records)
    assert m is not None and m["seq"] == 1 and m["ranks"] == [0, 1]
    assert m["text"] == "rank 0 all_reduce [[2, 3]] vs rank 1 all_reduce [[3, 2]]"
    # Three ranks, rank 2 never joins the third collective.
    records = [coll(r, s, 1) for r in range(3) for s in range(3 if r < 2 else 2)]
    m = analysis.collective_mismatch(records)
    assert m is not None and m["seq"] == 2
    assert [(s["ranks"], s["missing"]) for s in m["sides"]] == [([0, 1], False), ([2], True)]


def test_divergence_majority_and_tie() -> None:
    prints = [
        fp(r, s, k, "b" if (r == 2 and s >= 5) else f"a{s}{k}")
        for r in range(4)
        for s in range(8)
        for k in ("grad", "param")
    ]
    d = analysis.rank_divergence(prints)
    assert d is not None
    assert [(x["rank"], x["from_step"], x["kind"]) for x in d["ranks"]] == [(2, 5, "grad")]
    assert d["reference_ranks"] == [0, 1, 3]
    assert d["text"] == "only rank 2 diverges from the others, from step 5 (grads)"
    # Two ranks that disagree: the group holding the lowest rank is the reference.
    d = analysis.rank_divergence([fp(0, 0, "param", "x"), fp(1, 0, "param", "y")])
    assert d is not None and [x["rank"] for x in d["ranks"]] == [1]
    assert analysis.rank_divergence([fp(r, 0, "param", "same") for r in range(3)]) is None


def test_compile_divergence_names_the_rank_that_recompiled() -> None:
    events = [compile_event(r, 0, "compile") for r in range(3)]
    assert analysis.compile_divergence(events) is None
    events.append(compile_event(1, 1, "recompile", shapes="[[5]]"))
    c = analysis.compile_divergence(events)
    assert c is not None
    assert [(r["rank"], r["recompile"]) for r in c["ranks"]] == [(1, 1)]
    assert c["reference_ranks"] == [0, 2]
    assert c["ranks"][0]["only_here"] == ["recompile forward [[5]]"]


def test_first_failure_is_the_earliest_failed_rank() -> None:
    ranks = [
        {"rank": 0, "status": "failed", "ended_at": 12.0, "error": "gloo: connection closed by peer"},
        {"rank": 1, "status": "failed", "ended_at": 10.0, "exit_code": 1, "error": "RuntimeError: boom"},
        {"rank": 2, "status": "interrupted", "ended_at": 9.0},
        {"rank": 3, "status": "lost"},
    ]
    f = analysis.first_failure(ranks)
    assert f is not None and (f["rank"], f["error"]) == (1, "RuntimeError: boom")
    assert analysis.first_failure([{"rank": 0, "status": "ok"}]) is None


def test_shard_spool_writes_hive_partitions_and_moves_staged_parts(tmp_path: Path) -> None:
    root = tmp_path / "shards"
    spool = ShardSpool(root, tmp_path / "staging", "run1", None, attempt=2)
    spool.write_records(Step, [Step("run1", 0, 0, 10, "optimizer"), Step("run1", 1, 10, 12, "optimizer")])
    assert not (root / "steps").exists()  # rank unknown: staged
    spool.set_rank(3)
    spool.write_records(RankInfo, [RankInfo("run1", 3, restart=2, status="ok")])
    spool.write_table("dist_collectives", records_to_arrow(Collective, [coll(3, 0, 1.0)]))
    assert not (tmp_path / "staging").exists()
    files = sorted(p.relative_to(root).parts[:3] for p in root.rglob("*.parquet"))
    assert files == [
        ("dist_collectives", "run_id=run1", "rank=3"),
        ("dist_ranks", "run_id=run1", "rank=3"),
        ("steps", "run_id=run1", "rank=3"),
    ]
    # The partition columns are in the folder names only (Spark refuses a column in both places).
    assert "rank" not in shard_schema("steps").names and "restart" in shard_schema("steps").names
    with duckdb.connect() as con:
        rows = con.execute(
            f"SELECT run_id, rank, restart, step FROM read_parquet('{table_glob(root, 'steps')}', "
            "hive_partitioning = true) ORDER BY step"
        ).fetchall()
    assert rows == [("run1", 3, 2, 0), ("run1", 3, 2, 1)]
    with pytest.raises(ValueError):
        spool.write_table("nope", pa.table({"a": [1]}))


def test_collective_bytes() -> None:
    from tpudiag.distributed.merge import collective_bytes

    assert collective_bytes("[[2, 4]]", '["float"]') == 32
    assert collective_bytes("[[3], [5]]", '["long int", "c10::BFloat16"]') == 3 * 8 + 5 * 2
    assert collective_bytes("[[]]", '["float"]') == 4  # a scalar
    assert collective_bytes(None, None) is None
    assert collective_bytes("not json", None) is None
