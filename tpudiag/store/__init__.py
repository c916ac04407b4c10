"""The store: the only package that talks to DuckDB (DDL, schema version, migrations, writes and queries)."""

from tpudiag.store.database import DEFAULT_DB, Store, resolve_db_path
from tpudiag.store.schema import SCHEMA_VERSION

__all__ = ["DEFAULT_DB", "SCHEMA_VERSION", "Store", "resolve_db_path"]
