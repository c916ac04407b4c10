"""SQL of every rank's numerics in a distributed run: ``dist_op_diffs`` and ``dist_numerics``.

The run's own ``ops`` / ``op_diffs`` tables hold one rank's numerics (the lowest of the last attempt), so the
single-run report, the dashboard and ``repro`` read as for any run.  A fault on another rank would never reach them,
so at merge two small per-rank tables are filled from every rank's shards:

- ``dist_op_diffs``: the listed outputs (a role, or a verdict other than pass/skip) of every rank, with their op,
  at most ``MAX_ROWS_PER_RANK`` per rank attempt (in execution order);
- ``dist_numerics``: per rank attempt and (op, module): calls checked, divergent, expected precision, worst scaled
  error, and where the first divergent call was (what ``compare`` / ``check`` read).

Both are bounded by what diverged and by distinct ops, never by run length.  Created when first needed, so older
stores keep their schema; every read returns "nothing" when a table is absent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tpudiag.store import distributed_queries as shards

if TYPE_CHECKING:
    import duckdb

MAX_ROWS_PER_RANK = 2000
LISTED_VERDICTS = ("fail", "overflow", "expected_precision")
FAIL_VERDICTS = ("fail", "overflow")

OP_DIFF_COLUMNS = (
    ("run_id", "VARCHAR"), ("rank", "BIGINT"), ("restart", "BIGINT"), ("seq", "BIGINT"), ("output_index", "BIGINT"),
    ("op", "VARCHAR"), ("overload", "VARCHAR"), ("module", "VARCHAR"), ("phase", "VARCHAR"),
    ("source_loc", "VARCHAR"), ("step", "BIGINT"), ("kind", "VARCHAR"), ("region", "VARCHAR"),
    ("graph_id", "VARCHAR"), ("fx_node", "VARCHAR"), ("verdict", "VARCHAR"), ("role", "VARCHAR"),
    ("dtype", "VARCHAR"), ("numel", "BIGINT"), ("max_abs", "DOUBLE"), ("max_rel", "DOUBLE"), ("rmse", "DOUBLE"),
    ("scaled_error", "DOUBLE"), ("propagated_error", "DOUBLE"), ("threshold", "DOUBLE"), ("ref_rmse", "DOUBLE"),
    ("nan_device", "BIGINT"), ("inf_device", "BIGINT"), ("note", "VARCHAR"), ("precision", "VARCHAR"),
    ("repro_path", "VARCHAR"),
)  # fmt: skip
NUMERICS_COLUMNS = (
    ("run_id", "VARCHAR"), ("rank", "BIGINT"), ("restart", "BIGINT"), ("op", "VARCHAR"), ("module", "VARCHAR"),
    ("checked", "BIGINT"), ("divergent", "BIGINT"), ("expected_precision", "BIGINT"),
    ("max_scaled_error", "DOUBLE"), ("first_seq", "BIGINT"), ("first_source", "VARCHAR"),
    ("first_phase", "VARCHAR"), ("seq", "BIGINT"),
)  # fmt: skip
_OP_COLS = {"op", "overload", "module", "phase", "source_loc", "step", "kind", "region", "graph_id", "fx_node"}


def ensure_tables(con: duckdb.DuckDBPyConnection) -> None:
    for name, cols in (("dist_op_diffs", OP_DIFF_COLUMNS), ("dist_numerics", NUMERICS_COLUMNS)):
        con.execute(f"CREATE TABLE IF NOT EXISTS {name} ({', '.join(f'{n} {t}' for n, t in cols)})")


def _has(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    rows = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [table]).fetchall()
    return bool(rows and rows[0][0])


def _source(root: shards.Root, table: str) -> str | None:
    """The shards of ``table`` as one hive-partitioned read, or None when no rank wrote any."""
    return shards._source(root, table) if shards.shard_files(root, table) else None


def load(con: duckdb.DuckDBPyConnection, root: shards.Root, run_id: str) -> None:
    """Every rank's listed outputs and per-op counts from the shards under ``root`` (replacing earlier ones)."""
    ensure_tables(con)
    for table in ("dist_op_diffs", "dist_numerics"):
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
    ops, diffs = _source(root, "ops"), _source(root, "op_diffs")
    if ops is None or diffs is None:
        return
    cols = ", ".join(
        f"o.{n}" if n in _OP_COLS else f"d.{n}" for n, _ in OP_DIFF_COLUMNS if n not in ("run_id", "rank", "restart")
    )
    con.execute(
        f"""
        INSERT INTO dist_op_diffs BY NAME
        WITH d AS (
            SELECT *, row_number() OVER (PARTITION BY rank, restart ORDER BY seq, output_index) AS n
            FROM {diffs} WHERE role IS NOT NULL OR list_contains(?, verdict)
        )
        SELECT ? AS run_id, d.rank, d.restart, {cols}
        FROM d JOIN {ops} o ON o.rank = d.rank AND o.restart = d.restart AND o.seq = d.seq AND o.checked
        WHERE d.n <= ?
        """,
        [list(LISTED_VERDICTS), run_id, MAX_ROWS_PER_RANK],
    )
    con.execute(
        f"""
        INSERT INTO dist_numerics BY NAME
        WITH per_call AS (
            SELECT o.rank, o.restart, o.seq, o.op, o.module, o.phase, o.source_loc,
                   bool_or(list_contains(?, d.verdict)) AS failed,
                   bool_or(d.verdict = 'expected_precision') AS expected,
                   max(d.scaled_error) AS scaled_error
            FROM {ops} o JOIN {diffs} d ON d.rank = o.rank AND d.restart = o.restart AND d.seq = o.seq
            WHERE o.checked AND d.verdict <> 'skip'
            GROUP BY ALL
        )
        SELECT ? AS run_id, rank, restart, op, module, count(*) AS checked,
               count(*) FILTER (WHERE failed) AS divergent,
               count(*) FILTER (WHERE expected) AS expected_precision,
               max(scaled_error) AS max_scaled_error,
               min(seq) FILTER (WHERE failed) AS first_seq,
               arg_min(source_loc, seq) FILTER (WHERE failed) AS first_source,
               arg_min(phase, seq) FILTER (WHERE failed) AS first_phase,
               min(seq) AS seq
        FROM per_call GROUP BY rank, restart, op, module
        """,
        [list(FAIL_VERDICTS), run_id],
    )


def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    cols = [d[0] for d in cur.description or []]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def last_attempt(con: duckdb.DuckDBPyConnection, run_id: str) -> int | None:
    if not _has(con, "dist_ranks"):
        return None
    row = con.execute("SELECT max(restart) FROM dist_ranks WHERE run_id = ?", [run_id]).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def rank_outputs(con: duckdb.DuckDBPyConnection, run_id: str, attempt: int) -> list[dict[str, Any]]:
    """Every rank's listed outputs of one attempt, in (seq, rank, output) order."""
    if not _has(con, "dist_op_diffs"):
        return []
    cur = con.execute(
        "SELECT *, overload AS target FROM dist_op_diffs WHERE run_id = ? AND restart = ? "
        "ORDER BY seq, rank, output_index",
        [run_id, attempt],
    )
    return _dicts(cur)


def rank_coverage(con: duckdb.DuckDBPyConnection, run_id: str, attempt: int) -> dict[int, dict[str, int]]:
    """Per rank of one attempt: op calls checked, divergent, expected precision (from ``dist_numerics``)."""
    if not _has(con, "dist_numerics"):
        return {}
    rows = con.execute(
        "SELECT rank, sum(checked), sum(divergent), sum(expected_precision) FROM dist_numerics "
        "WHERE run_id = ? AND restart = ? GROUP BY rank ORDER BY rank",
        [run_id, attempt],
    ).fetchall()
    return {int(r): {"checked": int(c), "divergent": int(d), "expected_precision": int(e)} for r, c, d, e in rows}


def numerics_over_ranks(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]] | None:
    """Numerics per (op, module) summed over every rank of the last attempt, in ``compare_queries``' shape;
    None for a run without per-rank numerics (a single process)."""
    attempt = last_attempt(con, run_id)
    if attempt is None or not _has(con, "dist_numerics"):
        return None
    rows = _dicts(
        con.execute(
            """
            SELECT op, module, sum(checked) AS checked, sum(divergent) AS divergent,
                   sum(expected_precision) AS expected_precision, max(max_scaled_error) AS max_scaled_error,
                   min(first_seq) AS first_seq, arg_min(first_source, first_seq) AS first_source,
                   arg_min(first_phase, first_seq) AS first_phase, min(seq) AS seq
            FROM dist_numerics WHERE run_id = ? AND restart = ? GROUP BY op, module ORDER BY min(seq), op, module
            """,
            [run_id, attempt],
        )
    )
    return rows or None


def rank_op(con: duckdb.DuckDBPyConnection, run_id: str, rank: int, seq: int) -> dict[str, Any] | None:
    """One listed op call of one rank (last attempt), with the rank's artifacts folder, or None."""
    attempt = last_attempt(con, run_id)
    if attempt is None or not _has(con, "dist_op_diffs"):
        return None
    rows = _dicts(
        con.execute(
            "SELECT d.*, r.artifacts_dir FROM dist_op_diffs d LEFT JOIN dist_ranks r ON r.run_id = d.run_id "
            "AND r.rank = d.rank AND r.restart = d.restart WHERE d.run_id = ? AND d.restart = ? AND d.rank = ? "
            "AND d.seq = ? ORDER BY d.output_index",
            [run_id, attempt, rank, seq],
        )
    )
    return rows[0] if rows else None
