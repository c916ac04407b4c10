"""SQL of distributed runs: the ``dist_*`` tables, loading rank shards into a run, and the per-rank reads.

The ``dist_*`` tables are created when the first distributed run is stored (``CREATE TABLE IF NOT EXISTS``), so
stores without one keep their schema.  Shards are read with one hive-partitioned glob per table; ``run_id`` and
``rank`` come from the folder names.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from tpudiag.distributed.analysis import Lateness
from tpudiag.distributed.records import Collective, Fingerprint, RankInfo
from tpudiag.distributed.shards import table_glob
from tpudiag.model import BULK_TABLES, CompileEvent, Step, column_kinds, is_table_name

if TYPE_CHECKING:
    import duckdb
    import pyarrow as pa

_DUCK = {"int": "BIGINT", "float": "DOUBLE", "bool": "BOOLEAN", "str": "VARCHAR"}
# Per-rank copies of model tables, every attempt kept: (store table, record type it mirrors).
RANK_TABLES: dict[str, type[Any]] = {"dist_steps": Step, "dist_compile_events": CompileEvent}
# Per (rank, attempt): the step figures of the ranks' pulse (every step), derived at load time (never exported).
STEP_FIGURES = "dist_step_figures"
_STEP_FIGURES_DDL = (
    f"CREATE TABLE IF NOT EXISTS {STEP_FIGURES} (run_id VARCHAR, rank BIGINT, restart BIGINT, steps BIGINT, "
    "min_ns BIGINT, max_ns BIGINT, median_ns DOUBLE)"
)
OWN_TABLES: dict[str, type[Any]] = {c.TABLE: c for c in (RankInfo, Fingerprint, Collective)}
ALL_TABLES = (*OWN_TABLES, *RANK_TABLES)
# Rank data loaded into the run's main tables gets ids offset by rank, so ids stay unique within the run.
ID_SHIFT = 36
_HIVE = "hive_partitioning = true, hive_types = {'run_id': VARCHAR, 'rank': BIGINT}, union_by_name = true"


def _columns(cls: type[Any], with_attempt: bool) -> list[tuple[str, str]]:
    cols = list(column_kinds(cls))
    if with_attempt and "restart" not in {n for n, _ in cols}:
        cols.append(("restart", "int"))
    return cols


def ensure_tables(con: duckdb.DuckDBPyConnection) -> None:
    for name, cls in {**OWN_TABLES, **RANK_TABLES}.items():
        cols = ", ".join(f'"{n}" {_DUCK[k]}' for n, k in _columns(cls, with_attempt=True))
        con.execute(f"CREATE TABLE IF NOT EXISTS {name} ({cols})")
    con.execute(_STEP_FIGURES_DDL)


def has_tables(con: duckdb.DuckDBPyConnection) -> bool:
    return table_exists(con, "dist_ranks")


def table_exists(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    rows = con.execute("SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [table]).fetchall()
    return bool(rows and rows[0][0])


class ShardSource(Protocol):
    """Shards that are not a local folder (``tpudiag.remote.reader``: objects in a bucket)."""

    def files(self, table: str) -> list[str]: ...

    def source(self, table: str) -> str: ...


Root = Path | ShardSource


def shard_files(root: Root, table: str) -> list[str]:
    if not isinstance(root, Path):
        return root.files(table)
    folder = root / table
    return sorted(str(p) for p in folder.glob("*/*/*.parquet")) if folder.is_dir() else []


def _source(root: Root, table: str) -> str:
    if not isinstance(root, Path):
        return root.source(table)
    return f"read_parquet('{table_glob(root, table)}', {_HIVE})"


def clear_run(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    for table in (*ALL_TABLES, STEP_FIGURES):
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])


def load_rank_tables(con: duckdb.DuckDBPyConnection, root: Root, run_id: str) -> None:
    """Every attempt of every rank into the ``dist_*`` tables (collectives are derived separately)."""
    pairs = {RankInfo.TABLE: RankInfo.TABLE, Fingerprint.TABLE: Fingerprint.TABLE}
    pairs.update({name: cls.TABLE for name, cls in RANK_TABLES.items()})
    for store_table, shard_table in pairs.items():
        if not shard_files(root, shard_table):
            continue
        con.execute(
            f"INSERT INTO {store_table} BY NAME SELECT * REPLACE (? AS run_id) FROM {_source(root, shard_table)}",
            [run_id],
        )
    if shard_files(root, "pulse"):
        # A step's period: the step and the gap before it (data loading, everything between steps).
        con.execute(
            f"INSERT INTO {STEP_FIGURES} SELECT ?, rank, restart, count(*), min(p), max(p), median(p) FROM "
            f"(SELECT rank, restart, dur_ns + coalesce(gap_ns, 0) AS p FROM {_source(root, 'pulse')}) "
            "GROUP BY rank, restart",
            [run_id],
        )


def set_run_owner(con: duckdb.DuckDBPyConnection, run_id: str, host: str, pid: int) -> None:
    con.execute("UPDATE runs SET host = ?, pid = ? WHERE id = ? AND status = 'running'", [host, pid, run_id])


MAIN_TABLES = (
    "trace_events", "steps", "compile_events", "ops", "op_diffs",
    # Every rank's pulse, trace windows and memory figures (issues 21, 22: each row says its rank).
    "pulse", "trace_windows", "memory_steps", "memory_blocks", "memory_timeline", "memory_oom", "memory_oom_allocs",
)  # fmt: skip


def load_main_tables(con: duckdb.DuckDBPyConnection, root: Path, run_id: str, attempt: int, ops_rank: int) -> None:
    """One attempt's rank data into the run's own tables (what the single-run report, dashboard and exports read).

    Trace events, steps, compile events, the pulse, trace windows and memory figures of every rank (ids offset by
    rank); ops and op diffs of ``ops_rank`` only, so the numerics section reads as one rank's.
    """
    shift = f"((rank + 1) << {ID_SHIFT})"
    for table in MAIN_TABLES:  # a second merge (another node of the job finishing later) replaces, never adds
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
    plans = {
        "trace_events": f"event_id + {shift} AS event_id, parent_id + {shift} AS parent_id, "
        f"launch_id + {shift} AS launch_id",
        "steps": None,
        "compile_events": f"seq + {shift} AS seq",
        "ops": None,
        "op_diffs": None,
        # A window's first event id points into trace_events, whose ids are offset by rank here.
        "trace_windows": f"first_event_id + {shift} AS first_event_id",
    }
    plans.update({t: None for t in MAIN_TABLES if t not in plans})
    for table, replace in plans.items():
        if not shard_files(root, table):
            continue
        drop = "restart, rank" if table in ("ops", "op_diffs") else "restart"  # these two have no rank column
        select = f"* EXCLUDE ({drop}) REPLACE (? AS run_id{', ' + replace if replace else ''})"
        where = "restart = ?" + (" AND rank = ?" if table in ("ops", "op_diffs") else "")
        params: list[Any] = [run_id, attempt] + ([ops_rank] if table in ("ops", "op_diffs") else [])
        con.execute(f"INSERT INTO {table} BY NAME SELECT {select} FROM {_source(root, table)} WHERE {where}", params)
    load_declared_tables(con, root, run_id, attempt)


def declared_tables(root: Path) -> list[str]:
    """Tables in the shards that collectors declared (``Collector.tables``): neither built-in nor ``dist_*``."""
    known = set(BULK_TABLES) | set(OWN_TABLES) | set(RANK_TABLES)
    try:
        names = sorted(p.name for p in root.iterdir() if p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [
        t for t in names if t not in known and is_table_name(t) and not t.startswith("dist_") and shard_files(root, t)
    ]


def load_declared_tables(con: duckdb.DuckDBPyConnection, root: Path, run_id: str, attempt: int) -> None:
    """One attempt's rows of every collector-declared table, every rank, into the run's table of that name
    (created from the shards' columns when missing; a ``rank`` column comes from the shard folders)."""
    for table in declared_tables(root):
        select = f"SELECT * EXCLUDE (restart) REPLACE (? AS run_id) FROM {_source(root, table)} WHERE restart = ?"
        con.execute(f"CREATE TABLE IF NOT EXISTS {table} AS {select} LIMIT 0", [run_id, attempt])
        cols = [r[0] for r in con.execute(f"SELECT * FROM {table} LIMIT 0").description]
        con.execute(f"DELETE FROM {table} WHERE run_id = ?", [run_id])
        picked = ", ".join(f'"{c}"' for c in cols)
        con.execute(f"INSERT INTO {table} BY NAME SELECT {picked} FROM ({select})", [run_id, attempt])


SizeKey = tuple[str | None, str | None]


# The bucket reader (``tpudiag.remote.reader``, under a memory limit) numbers ranks in batches: the window query
# then holds one batch's rows, not the job's.  A local merge numbers them in one pass (a batch is one more scan).
RANK_BATCH = 64
COLLECTIVE_ROWS = "category = 'user_annotation' AND (starts_with(name, 'gloo:') OR starts_with(name, 'nccl:'))"


def load_collectives(con: duckdb.DuckDBPyConnection, root: Root, run_id: str) -> list[SizeKey]:
    """Every rank's communication ranges (gloo/NCCL annotations) into ``dist_collectives``, numbered per rank in
    the order it entered them; returns the distinct (shapes, dtypes) pairs, whose byte counts ``set_bytes`` adds."""
    if not shard_files(root, "trace_events"):
        return []
    source = _source(root, "trace_events")
    batches: list[tuple[int, int]] | None = None  # [low, high) rank ranges; None: every rank at once
    if not isinstance(root, Path):
        bounds = con.execute(f"SELECT min(rank), max(rank) FROM {source} WHERE {COLLECTIVE_ROWS}").fetchone()
        low, high = bounds if bounds and bounds[0] is not None else (0, -1)  # (0, -1): no collective at all
        batches = [(r, r + RANK_BATCH) for r in range(int(low), int(high) + 1, RANK_BATCH)]
    for batch in [None] if batches is None else batches:
        con.execute(
            f"""
            INSERT INTO dist_collectives BY NAME
            SELECT ? AS run_id, rank, restart, split_part(name, ':', 2) AS op, shapes, dtypes, start_ns, dur_ns,
                   row_number() OVER (PARTITION BY rank, restart ORDER BY start_ns, event_id) - 1 AS seq
            FROM {source}
            WHERE {COLLECTIVE_ROWS} {"" if batch is None else "AND rank >= ? AND rank < ?"}
            """,
            [run_id, *(batch or ())],
        )
    rows = con.execute("SELECT DISTINCT shapes, dtypes FROM dist_collectives WHERE run_id = ?", [run_id]).fetchall()
    return [(a, b) for a, b in rows]


def set_bytes(
    con: duckdb.DuckDBPyConnection, run_id: str, sizes: dict[tuple[str | None, str | None], int | None]
) -> None:
    # A few distinct (shapes, dtypes) pairs: plain rows, no Arrow (registering Arrow data in DuckDB imports pandas
    # too, ~85 MB that a bucket reader would carry for a handful of numbers).
    known = [(k[0], k[1], v) for k, v in sizes.items() if v is not None]
    if not known:
        return
    con.execute("CREATE OR REPLACE TEMP TABLE tpudiag_dist_sizes (shapes VARCHAR, dtypes VARCHAR, n BIGINT)")
    try:
        con.executemany("INSERT INTO tpudiag_dist_sizes VALUES (?, ?, ?)", known)
        con.execute(
            "UPDATE dist_collectives AS c SET bytes = s.n FROM tpudiag_dist_sizes AS s "
            "WHERE c.run_id = ? AND c.shapes IS NOT DISTINCT FROM s.shapes AND c.dtypes IS NOT DISTINCT FROM s.dtypes",
            [run_id],
        )
    finally:
        con.execute("DROP TABLE IF EXISTS tpudiag_dist_sizes")


def insert_arrow(con: duckdb.DuckDBPyConnection, table: str, data: pa.Table) -> None:
    if data.num_rows == 0:
        return
    con.register("tpudiag_dist_rows", data)
    try:
        con.execute(f"INSERT INTO {table} BY NAME SELECT * FROM tpudiag_dist_rows")
    finally:
        con.unregister("tpudiag_dist_rows")


def numerics_counts(con: duckdb.DuckDBPyConnection, root: Root) -> list[tuple[int, int, int, int]]:
    """(rank, attempt, outputs compared, failing outputs) from every rank's op diffs."""
    if not shard_files(root, "op_diffs"):
        return []
    rows = con.execute(
        f"SELECT rank, restart, count(*) FILTER (WHERE verdict != 'skip'), count(*) FILTER (WHERE verdict = 'fail') "
        f"FROM {_source(root, 'op_diffs')} GROUP BY rank, restart"
    ).fetchall()
    return [(int(a), int(b), int(c), int(d)) for a, b, c, d in rows]


def set_numerics_counts(con: duckdb.DuckDBPyConnection, run_id: str, counts: list[tuple[int, int, int, int]]) -> None:
    for rank, attempt, checked, failures in counts:
        con.execute(
            "UPDATE dist_ranks SET numerics_checked = ?, numerics_failures = ? "
            "WHERE run_id = ? AND rank = ? AND restart = ?",
            [checked, failures, run_id, rank, attempt],
        )


def present_ranks(con: duckdb.DuckDBPyConnection, root: Root) -> set[tuple[int, int]]:
    """(rank, attempt) of every rank that wrote anything at all."""
    found: set[tuple[int, int]] = set()
    for table in ("trace_events", "steps", "compile_events", "ops", Fingerprint.TABLE, "pulse"):
        if shard_files(root, table):
            rows = con.execute(f"SELECT DISTINCT rank, restart FROM {_source(root, table)}").fetchall()
            found |= {(int(r), int(a)) for r, a in rows}
    return found


# -- reads (report, dashboard) ------------------------------------------------------------------------------------
def _dicts(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    cols = [d[0] for d in cur.description or []]
    return [dict(zip(cols, row, strict=True)) for row in cur.fetchall()]


def ranks(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    return _dicts(con.execute("SELECT * FROM dist_ranks WHERE run_id = ? ORDER BY restart, rank", [run_id]))


def collectives(con: duckdb.DuckDBPyConnection, run_id: str, attempt: int) -> list[Collective]:
    cur = con.execute(
        "SELECT * FROM dist_collectives WHERE run_id = ? AND restart = ? ORDER BY rank, seq", [run_id, attempt]
    )
    names = [d[0] for d in cur.description or []]
    return [Collective(**dict(zip(names, row, strict=True))) for row in cur.fetchall()]


def collective_counts(con: duckdb.DuckDBPyConnection, run_id: str, restart: int) -> dict[int, dict[str, Any]]:
    """Per rank: collectives run, seconds inside them, bytes moved."""
    rows = con.execute(
        "SELECT rank, count(*), coalesce(sum(dur_ns), 0), coalesce(sum(bytes), 0) FROM dist_collectives "
        "WHERE run_id = ? AND restart = ? GROUP BY rank",
        [run_id, restart],
    ).fetchall()
    return {
        int(r): {"collectives": int(n), "collective_s": round(float(ns) / 1e9, 6), "collective_bytes": int(b)}
        for r, n, ns, b in rows
    }


def first_mismatch(con: duckdb.DuckDBPyConnection, run_id: str, restart: int) -> list[Collective]:
    """The collectives at the first seq where ranks differ (op, shapes, dtypes) or one is missing; [] if none."""
    rows = con.execute(
        """
        WITH c AS (SELECT * FROM dist_collectives WHERE run_id = ? AND restart = ?),
        s AS (
            SELECT seq, count(DISTINCT (op, coalesce(shapes, ''), coalesce(dtypes, ''))) AS sigs, count(*) AS n
            FROM c GROUP BY seq
        )
        SELECT min(seq) FROM s WHERE sigs > 1 OR n < (SELECT count(DISTINCT rank) FROM c)
        """,
        [run_id, restart],
    ).fetchall()
    if not rows or rows[0][0] is None:
        return []
    cur = con.execute(
        "SELECT * FROM dist_collectives WHERE run_id = ? AND restart = ? AND seq = ? ORDER BY rank",
        [run_id, restart, int(rows[0][0])],
    )
    names = [d[0] for d in cur.description or []]
    return [Collective(**dict(zip(names, row, strict=True))) for row in cur.fetchall()]


def lateness(con: duckdb.DuckDBPyConnection, run_id: str, restart: int, count: int) -> list[Lateness]:
    """``analysis.lateness`` in SQL: per collective, the rank that waited least and the others' median wait."""
    rows = con.execute(
        """
        WITH o AS (
            SELECT seq, rank, coalesce(dur_ns, 0)::DOUBLE AS d,
                   row_number() OVER (PARTITION BY seq ORDER BY coalesce(dur_ns, 0), rank) AS pos
            FROM dist_collectives WHERE run_id = ? AND restart = ? AND seq < ?
        )
        SELECT seq, min(rank) FILTER (WHERE pos = 1), min(d) FILTER (WHERE pos = 1), median(d) FILTER (WHERE pos > 1)
        FROM o GROUP BY seq HAVING count(*) > 1 ORDER BY seq
        """,
        [run_id, restart, count],
    ).fetchall()
    return [Lateness(int(a), int(b), float(c), float(d)) for a, b, c, d in rows]


def waits_before(con: duckdb.DuckDBPyConnection, run_id: str, restart: int, count: int) -> dict[int, float]:
    rows = con.execute(
        "SELECT rank, coalesce(sum(dur_ns), 0) FROM dist_collectives WHERE run_id = ? AND restart = ? AND seq < ? "
        "GROUP BY rank",
        [run_id, restart, count],
    ).fetchall()
    return {int(r): float(ns) for r, ns in rows}


def divergent_fingerprints(con: duckdb.DuckDBPyConnection, run_id: str, attempt: int) -> list[Fingerprint]:
    """The fingerprints of the (step, kind) cells where ranks disagree: in a job whose ranks agree, none come back."""
    cur = con.execute(
        """
        SELECT f.* FROM dist_fingerprints f SEMI JOIN (
            SELECT step, kind FROM dist_fingerprints WHERE run_id = $run AND restart = $attempt
            GROUP BY step, kind HAVING count(DISTINCT fingerprint) > 1
        ) d ON d.step = f.step AND d.kind = f.kind
        WHERE f.run_id = $run AND f.restart = $attempt ORDER BY f.step, f.kind, f.rank
        """,
        {"run": run_id, "attempt": attempt},
    )
    return [Fingerprint(**row) for row in _dicts(cur)]


def fingerprint_ranks(con: duckdb.DuckDBPyConnection, run_id: str, attempt: int) -> list[int]:
    rows = con.execute(
        "SELECT DISTINCT rank FROM dist_fingerprints WHERE run_id = ? AND restart = ? ORDER BY rank", [run_id, attempt]
    ).fetchall()
    return [int(r[0]) for r in rows]


def step_spread(con: duckdb.DuckDBPyConnection, run_id: str, attempt: int) -> dict[int, dict[str, Any]]:
    """``analysis.step_spread`` per rank in SQL: count, min, max and the one or two middle durations.

    From the ranks' pulse when they kept one (every step: its period, the gap before it included), else from the
    steps their traces saw (with trace windows, only the windows' steps)."""
    if table_exists(con, STEP_FIGURES):  # not in a store merged before the pulse existed
        figures = con.execute(
            f"SELECT rank, steps, min_ns, max_ns, median_ns FROM {STEP_FIGURES} WHERE run_id = ? AND restart = ?",
            [run_id, attempt],
        ).fetchall()
        if figures:
            return {int(r): _figures(int(n), int(mn), int(mx), float(med)) for r, n, mn, mx, med in figures}
    rows = con.execute(
        """
        SELECT rank, n, mn, mx, l[(n - 1) // 2 + 1], l[n // 2 + 1] FROM (
            SELECT rank, count(*) AS n, min(dur_ns) AS mn, max(dur_ns) AS mx, list_sort(list(dur_ns)) AS l
            FROM dist_steps WHERE run_id = ? AND restart = ? GROUP BY rank
        )
        """,
        [run_id, attempt],
    ).fetchall()
    out: dict[int, dict[str, Any]] = {}
    for rank, n, mn, mx, lo, hi in rows:
        median = int(lo) if n % 2 else (int(lo) + int(hi)) / 2  # as statistics.median of the durations
        out[int(rank)] = _figures(int(n), int(mn), int(mx), median)
    return out


def _figures(steps: int, min_ns: int, max_ns: int, median_ns: float) -> dict[str, Any]:
    return {
        "steps": steps,
        "step_median_s": round(median_ns / 1e9, 6),
        "step_min_s": round(min_ns / 1e9, 6),
        "step_max_s": round(max_ns / 1e9, 6),
    }


def compile_events(con: duckdb.DuckDBPyConnection, run_id: str, attempt: int) -> list[CompileEvent]:
    cur = con.execute(
        "SELECT * EXCLUDE (restart) FROM dist_compile_events WHERE run_id = ? AND restart = ? ORDER BY rank, seq",
        [run_id, attempt],
    )
    return [CompileEvent(**row) for row in _dicts(cur)]


# -- export -------------------------------------------------------------------------------------------------------
# Tables written per rank by ``tpudiag export --format parquet`` for a distributed run (those with a rank column).
EXPORT_TABLES = (*ALL_TABLES, "trace_events", "steps", "compile_events")


def export_partitions(con: duckdb.DuckDBPyConnection, run_id: str, out_dir: Path) -> list[Path]:
    """One run's per-rank tables as ``<out>/<table>/run_id=<id>/rank=<r>/*.parquet`` (the shards' layout)."""
    if not has_tables(con) or not con.execute("SELECT 1 FROM dist_ranks WHERE run_id = ? LIMIT 1", [run_id]).fetchall():
        return []
    written: list[Path] = []
    for table in EXPORT_TABLES:
        if (
            not table_exists(con, table)
            or not con.execute(f"SELECT 1 FROM {table} WHERE run_id = ? LIMIT 1", [run_id]).fetchall()
        ):
            continue
        target = out_dir / table
        out_dir.mkdir(parents=True, exist_ok=True)
        # COPY ... PARTITION_BY writes the hive folders and leaves run_id / rank out of the files, as the shards do.
        con.execute(
            f"COPY (SELECT * FROM {table} WHERE run_id = ?) TO '{target}' "
            "(FORMAT parquet, COMPRESSION zstd, PARTITION_BY (run_id, rank), OVERWRITE_OR_IGNORE)",
            [run_id],
        )
        written += sorted(target.glob("*/*/*.parquet"))
    return written


def mark_parent_rows(con: duckdb.DuckDBPyConnection, run_id: str) -> None:
    """The rows of a process that spawned the ranks (not a rank itself) get rank -1."""
    for table in ("trace_events", "steps", "compile_events"):
        con.execute(f"UPDATE {table} SET rank = -1 WHERE run_id = ?", [run_id])
