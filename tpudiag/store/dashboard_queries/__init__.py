"""Read queries behind the dashboard pages.

Each ``load_*`` function opens one short read-only connection (``Store.reader`` retries while a capture
writes), runs every query a page needs, closes it and returns plain Python values, so no connection outlives a
page run.  Aggregation happens in DuckDB: a page never loads a table, only the rows it shows.  Filters are
parameters; the only SQL text chosen at run time comes from fixed fragments in this package.  Each view records
how long each query took (``timings``, milliseconds), which the benchmark reads.
"""

from tpudiag.store.dashboard_queries.compile import CompileView, load_compile
from tpudiag.store.dashboard_queries.memory import MemoryView, load_memory
from tpudiag.store.dashboard_queries.numerics import NumericsView, load_numerics, load_op_diffs
from tpudiag.store.dashboard_queries.ops import (
    OpDetail,
    SlowOpsView,
    StepBreakdown,
    StepTimeline,
    load_op_detail,
    load_slow_ops,
    load_step_breakdown,
    load_step_timeline,
)
from tpudiag.store.dashboard_queries.runs import RunsView, list_run_choices, load_runs
from tpudiag.store.dashboard_queries.session import COMPILE_KINDS, GROUPINGS, PHASES, OpFilter

__all__ = [
    "COMPILE_KINDS",
    "GROUPINGS",
    "PHASES",
    "CompileView",
    "MemoryView",
    "NumericsView",
    "OpDetail",
    "OpFilter",
    "RunsView",
    "SlowOpsView",
    "StepBreakdown",
    "StepTimeline",
    "list_run_choices",
    "load_compile",
    "load_memory",
    "load_numerics",
    "load_op_detail",
    "load_op_diffs",
    "load_runs",
    "load_slow_ops",
    "load_step_breakdown",
    "load_step_timeline",
]
