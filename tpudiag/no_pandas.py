"""pandas reported as not installed, in a process of tpudiag's own that never hands pandas objects to Arrow or
DuckDB (the import command, the window analyst).

pyarrow imports pandas (~0.4-0.7 s of CPU, +43 MB of RSS) on its first ``pa.array()`` only to ask whether the input
is a pandas object; pyarrow and DuckDB both handle pandas being absent.  Never done once pandas is loaded, nor with
``TPUDIAG_WITH_PANDAS=1`` (or the import command's older ``TPUDIAG_IMPORT_WITH_PANDAS=1``).  The script's own process
is never touched: there tpudiag builds its Arrow tables without the check (``tpudiag.arrow_columns``).
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any


def skip() -> None:
    """From now on, in this process, ``import pandas`` fails as if pandas were not installed."""
    if "pandas" in sys.modules or os.environ.get("TPUDIAG_WITH_PANDAS") or os.environ.get("TPUDIAG_IMPORT_WITH_PANDAS"):
        return
    if not any(isinstance(finder, _NoPandas) for finder in sys.meta_path):
        sys.meta_path.insert(0, _NoPandas())


class _NoPandas(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "pandas" or fullname.startswith("pandas."):
            raise ModuleNotFoundError(f"No module named {fullname!r} (skipped by tpudiag)", name=fullname)
        return None
