"""The one place that opens DuckDB.

DuckDB lets one process write a file at a time and no reader beside it, so nobody holds the file for long:
captures spool Parquet parts to their run folder while the script runs and load them here in short transactions;
readers (report, dashboard) open read-only connections per query batch.  Every open retries while another process
holds the lock, up to a window (``TPUDIAG_LOCK_TIMEOUT`` seconds, default 60), then fails with one clear line.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpudiag.errors import StoreError, StoreLockedError
from tpudiag.model import BULK_TABLES, Run, column_names, is_table_name
from tpudiag.processes import pid_alive
from tpudiag.store import live_loads, pending
from tpudiag.store.pending import Finisher
from tpudiag.store.schema import MIGRATIONS, SCHEMA_VERSION, ddl

if TYPE_CHECKING:
    import duckdb

DEFAULT_DB = "tpudiag.duckdb"
_JSON_RUN_FIELDS = ("argv", "precision", "env", "collectors", "notes")


def resolve_db_path(explicit: str | None) -> Path:
    return Path(explicit or os.environ.get("TPUDIAG_DB") or DEFAULT_DB)


def lock_timeout() -> float:
    try:
        return float(os.environ.get("TPUDIAG_LOCK_TIMEOUT", "60"))
    except ValueError:
        return 60.0


def _no_progress_bar(con: duckdb.DuckDBPyConnection) -> None:
    """No progress bar: DuckDB would draw it on the user's terminal during long loads.  Inside a Jupyter kernel
    DuckDB refuses any change to that setting unless ``ipywidgets`` is installed (its bar there is a widget), and
    its bar is off there already: a notebook must not need ipywidgets."""
    import duckdb

    try:
        con.execute("SET enable_progress_bar = false")
    except duckdb.InvalidInputException as err:
        if "progress bar" not in str(err):
            raise


def _is_lock_error(err: Exception) -> bool:
    text = str(err)
    return "lock" in text.lower() or "different configuration" in text


class Store:
    """A tpudiag store: a DuckDB file plus a folder of per-run artifacts beside it."""

    def __init__(
        self, path: str | os.PathLike[str], lock_timeout_s: float | None = None, finisher: Finisher | None = None
    ) -> None:
        self.path = Path(path)
        # Stores a run whose background store write died (see store/pending.py); ``open_store`` hands one over.
        self.finisher = finisher
        self.lock_timeout_s = lock_timeout() if lock_timeout_s is None else lock_timeout_s
        if self.path.is_dir():
            raise StoreError(f"store path {self.path} is a directory, not a DuckDB file")

    # -- layout -----------------------------------------------------------------------------------------------
    @property
    def runs_dir(self) -> Path:
        """Artifacts (raw traces, spool parts, repro bundles) live in ``<store stem>.runs/<run id>/``."""
        return self.path.with_name(self.path.stem + ".runs")

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    def exists(self) -> bool:
        return self.path.exists()

    def check_file(self) -> None:
        """Fail now, without loading DuckDB, when the path holds something that is not a DuckDB file."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(12)
        except FileNotFoundError:
            return
        except OSError as err:
            raise StoreError(f"cannot open store {self.path}: {err.strerror}") from None
        if head and head[8:12] != b"DUCK":
            raise StoreError(f"{self.path} is not a tpudiag store (not a DuckDB database file)")

    # -- connections ------------------------------------------------------------------------------------------
    def _open(self, read_only: bool) -> duckdb.DuckDBPyConnection:
        import duckdb  # here, not at the top: commands that never open the store (--help) skip its import

        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.02
        while True:
            try:
                con = duckdb.connect(str(self.path), read_only=read_only)
                _no_progress_bar(con)
                return con
            except duckdb.Error as err:
                if not _is_lock_error(err):
                    if "not a valid DuckDB database" in str(err) or "Is a directory" in str(err):
                        raise StoreError(f"{self.path} is not a tpudiag store (not a DuckDB database file)") from None
                    raise StoreError(f"cannot open store {self.path}: {str(err).splitlines()[0]}") from None
                if time.monotonic() >= deadline:
                    raise StoreLockedError(
                        f"store {self.path} stayed locked by another process for {self.lock_timeout_s:g} s "
                        "(set TPUDIAG_LOCK_TIMEOUT to wait longer)"
                    ) from None
            time.sleep(delay * (0.5 + random.random()))
            delay = min(delay * 1.6, 0.5)

    @contextlib.contextmanager
    def writer(self) -> Iterator[duckdb.DuckDBPyConnection]:
        """A short write session: schema ensured, one transaction, committed on success."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        con = self._open(read_only=False)
        try:
            self._ensure_schema(con)
            con.execute("BEGIN TRANSACTION")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
        finally:
            con.close()

    @contextlib.contextmanager
    def reader(self, settle: bool = True) -> Iterator[duckdb.DuckDBPyConnection]:
        """A read-only connection, once every run being stored in the background is stored and every running
        capture's feeder has loaded what it spooled (``settle``: ``store/live_loads.py``)."""
        if settle:
            pending.settle(self, self.finisher)
            live_loads.ask_for_fresh(self.runs_dir)
        if not self.path.exists():
            raise StoreError(f"no store at {self.path} (capture a run first: tpudiag capture script.py)")
        con = self._open(read_only=True)
        try:
            self._check_version(con)
            yield con
        finally:
            con.close()

    def _stored_version(self, con: duckdb.DuckDBPyConnection) -> int | None:
        import duckdb

        # One cheap query: the first information_schema lookup of a connection costs ~30 ms.
        # fetchall(), not fetchone(): DuckDB 2 refuses the next query while a result is left unfinished.
        try:
            rows = con.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
        except (duckdb.CatalogException, duckdb.BinderException):  # no meta table (or not ours): not a tpudiag store
            return None
        return int(rows[0][0]) if rows else None

    def _check_version(self, con: duckdb.DuckDBPyConnection) -> None:
        version = self._stored_version(con)
        if version is None:
            raise StoreError(f"{self.path} is a DuckDB file but not a tpudiag store")
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path} was written by a newer tpudiag (schema {version}, this one reads up to "
                f"{SCHEMA_VERSION}): upgrade tpudiag"
            )
        if version < SCHEMA_VERSION:
            raise StoreError(
                f"store {self.path} has schema {version}: run any writing command (e.g. tpudiag runs --migrate) "
                "to migrate it"
            )

    def _ensure_schema(self, con: duckdb.DuckDBPyConnection) -> None:
        version = self._stored_version(con)
        if version is None:
            tables = con.execute("SELECT count(*) FROM information_schema.tables").fetchall()
            if tables and tables[0][0]:
                raise StoreError(f"{self.path} is a DuckDB file but not a tpudiag store; refusing to write to it")
            con.execute("BEGIN TRANSACTION")
            for stmt in ddl():
                con.execute(stmt)
            con.execute("INSERT INTO meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
            con.execute("COMMIT")
            return
        if version > SCHEMA_VERSION:
            self._check_version(con)
        while version < SCHEMA_VERSION:
            con.execute("BEGIN TRANSACTION")
            MIGRATIONS[version](con)
            version += 1
            con.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", [str(version)])
            con.execute("COMMIT")

    # -- runs -------------------------------------------------------------------------------------------------
    def put_run(self, run: Run, con: duckdb.DuckDBPyConnection | None = None, replace: bool = True) -> None:
        """Insert or replace a run row (``replace`` false: never over a row already there)."""
        names = column_names(Run)
        values = [json.dumps(getattr(run, n)) if n in _JSON_RUN_FIELDS else getattr(run, n) for n in names]
        verb = "INSERT OR REPLACE" if replace else "INSERT OR IGNORE"
        sql = f"{verb} INTO runs ({', '.join(names)}) VALUES ({', '.join('?' for _ in names)})"
        if con is not None:
            con.execute(sql, values)
            return
        with self.writer() as w:
            w.execute(sql, values)

    # -- ingest -----------------------------------------------------------------------------------------------
    def ingest_spool(self, run_id: str, spool_dir: Path, con: duckdb.DuckDBPyConnection | None = None) -> int:
        """Load every finished Parquet part under ``spool_dir`` into its table; returns rows loaded.

        Parts are loaded at most once (tracked in ``ingested_parts``) and deleted after the commit.
        """
        pending: dict[str, list[Path]] = {}
        for table in spool_tables(spool_dir):
            parts = sorted((spool_dir / table).glob("*.parquet"))
            if parts:
                pending[table] = parts
        if not pending:
            return 0
        loaded: list[Path] = []
        rows = 0

        def load(w: duckdb.DuckDBPyConnection) -> None:
            nonlocal rows
            done = {r[0] for r in w.execute("SELECT part FROM ingested_parts WHERE run_id = ?", [run_id]).fetchall()}
            for table, parts in pending.items():
                todo = [p for p in parts if f"{table}/{p.name}" not in done]
                loaded.extend(p for p in parts if f"{table}/{p.name}" in done)
                if not todo:
                    continue
                files = [str(p) for p in todo]
                if table not in BULK_TABLES:  # a collector's own table: created from its parts' (declared) schema
                    w.execute(f"CREATE TABLE IF NOT EXISTS {table} AS SELECT * FROM read_parquet(?) LIMIT 0", [files])
                res = w.execute(f"INSERT INTO {table} BY NAME SELECT * FROM read_parquet(?)", [files]).fetchone()
                rows += int(res[0]) if res else 0
                w.executemany(
                    "INSERT INTO ingested_parts VALUES (?, ?, ?)",
                    [[run_id, f"{table}/{p.name}", None] for p in todo],
                )
                loaded.extend(todo)

        if con is not None:
            load(con)
        else:
            with self.writer() as w:
                load(w)
        for p in loaded:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
        return rows

    def finish_run(self, run_id: str, spool_dir: Path, con: duckdb.DuckDBPyConnection) -> int:
        """Load a finished run's last spooled parts and build its op summary, in the caller's transaction."""
        rows = self.ingest_spool(run_id, spool_dir, con=con)
        self.summarize_run(run_id, con)
        return rows

    def store_finished(self, run: Run, spool_dir: Path) -> None:
        """A finished run in one transaction: its last spooled parts, its op summary and its final record."""
        with self.writer() as w:
            self.finish_run(run.id, spool_dir, con=w)
            self.put_run(run, con=w)

    def summarize_run(self, run_id: str, con: duckdb.DuckDBPyConnection) -> None:
        """(Re)build the run's rows of ``op_summary`` from its trace events (call when a run is finished)."""
        con.execute("DELETE FROM op_summary WHERE run_id = ?", [run_id])
        con.execute(
            """
            INSERT INTO op_summary
            SELECT run_id, name, module, phase, category, on_device, count(*), sum(self_ns), sum(dur_ns),
                   max(self_ns)
            FROM trace_events WHERE run_id = ?
            GROUP BY run_id, name, module, phase, category, on_device
            """,
            [run_id],
        )

    def recover_stale_runs(self) -> list[str]:
        """Mark runs whose capture process died (SIGKILL, os._exit) as interrupted, loading their spooled tail."""
        if not self.path.exists():
            return []
        host = socket.gethostname()
        with self.reader(settle=False) as r:  # a capture starting does not wait for the last one's store write
            rows = r.execute(
                "SELECT id, pid, started_at, artifacts_dir FROM runs WHERE status = 'running' AND host = ?",
                [host],
            ).fetchall()
        stale = [
            (rid, pid, started, adir)
            for rid, pid, started, adir in rows
            if pid and not pid_alive(pid) and not pending.is_pending(self, rid)  # its script did finish
        ]
        if not stale:
            return []
        for rid, *_ in stale:
            live_loads.stop(self.runs_dir, rid)  # its feeder was killed with it: readers do not ask it for loads
        with self.writer() as w:
            for rid, _pid, _started, adir in stale:
                if adir:
                    self.finish_run(rid, Path(adir) / "spool", con=w)
                else:
                    self.summarize_run(rid, w)
                w.execute(
                    "UPDATE runs SET status = 'interrupted', notes = ? WHERE id = ? AND status = 'running'",
                    [
                        json.dumps(
                            ["the capture process died before finishing (killed?); data up to its last flush was kept"]
                        ),
                        rid,
                    ],
                )
        return [s[0] for s in stale]


def spool_tables(spool_dir: Path) -> list[str]:
    """The tables a spool folder holds parts of: built-ins first, then collector-declared ones (their folder names,
    checked as SQL-safe names; the spool only writes tables registered with ``model.register_table``)."""
    try:
        names = sorted(p.name for p in spool_dir.iterdir() if p.is_dir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [t for t in BULK_TABLES if t in names] + [t for t in names if t not in BULK_TABLES and is_table_name(t)]


def decode_run(row: dict[str, Any]) -> dict[str, Any]:
    """A runs row as plain Python: JSON columns decoded."""
    out = dict(row)
    for key in _JSON_RUN_FIELDS:
        if isinstance(out.get(key), str):
            out[key] = json.loads(out[key])
    return out
