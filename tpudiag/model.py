"""The data model every part of tpudiag speaks.

Collectors produce these records, the store persists them, the report, the dashboard and the exporters read them.
Each record type is a frozen dataclass; its Arrow schema (used for spooling and bulk writes) is derived from the
dataclass fields, so the dataclass is the single source of truth for a table's columns.  Bulk producers (trace
parsers) build Arrow columns directly against ``arrow_schema(Cls)`` instead of instantiating millions of objects.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Union

if TYPE_CHECKING:
    import pyarrow as pa

RUN_STATUSES = ("running", "ok", "failed", "interrupted")


@dataclass(frozen=True)
class Run:
    """One capture or one import: the unit everything else hangs off."""

    TABLE: ClassVar[str] = "runs"

    id: str
    name: str
    status: str
    started_at: float  # epoch seconds
    exit_code: int | None = None
    source: str = "capture"  # "capture" | "import"
    script: str | None = None
    argv: list[str] = field(default_factory=list)
    cwd: str | None = None
    duration_s: float | None = None
    host: str | None = None
    pid: int | None = None
    python_version: str | None = None
    torch_version: str | None = None
    tpudiag_version: str | None = None
    device_kind: str | None = None  # "cpu" | "cuda" | "tpu"
    device_name: str | None = None
    precision: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    git_commit: str | None = None
    collectors: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    artifacts_dir: str | None = None

    @classmethod
    def from_record(cls, data: Mapping[str, Any]) -> Run:
        """A run from a record written elsewhere (a JSON file, a decoded store row): fields this version does not
        know (written by another one) are left out."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class TraceEvent:
    """One complete (begin+duration) profiler event, host or device."""

    TABLE: ClassVar[str] = "trace_events"

    run_id: str
    event_id: int  # unique within the run
    source: str  # "kineto" | "xplane"
    process: str  # Kineto pid / XPlane plane name
    thread: str  # Kineto tid / XPlane line name
    name: str
    category: str
    start_ns: int  # epoch nanoseconds
    dur_ns: int
    self_ns: int  # duration minus nested children on the same thread
    depth: int = 0
    parent_id: int | None = None
    rank: int = 0
    step: int | None = None
    module: str | None = None
    phase: str | None = None  # "forward" | "backward" | None
    source_loc: str | None = None
    shapes: str | None = None  # JSON list of input dims
    dtypes: str | None = None  # JSON list of input types
    seq_nr: int | None = None  # autograd sequence number
    external_id: int | None = None
    correlation: int | None = None  # host launch <-> device kernel link
    on_device: bool = False
    flops: float | None = None
    bytes_accessed: float | None = None
    framework_op: str | None = None  # device event: launching host op (GPU) / framework op of the HLO (TPU)
    hlo_category: str | None = None  # XLA op category (e.g. "convolution fusion"), device events only
    launch_id: int | None = None  # device event: event_id of the host op that launched it
    args: str | None = None  # remaining args as JSON


@dataclass(frozen=True)
class Step:
    """A training/inference step found in the trace."""

    TABLE: ClassVar[str] = "steps"

    run_id: str
    step: int
    start_ns: int
    dur_ns: int
    kind: str  # "profiler_step" | "optimizer" | "forward" | "whole"
    input_shapes: str | None = None  # JSON: shapes of the root module's inputs in this step
    rank: int = 0


@dataclass(frozen=True)
class OpRecord:
    """One executed aten op seen by the numerics collector."""

    TABLE: ClassVar[str] = "ops"

    run_id: str
    seq: int
    op: str
    step: int | None = None
    overload: str | None = None
    module: str | None = None
    phase: str | None = None
    source_loc: str | None = None
    dtypes: str | None = None
    shapes: str | None = None
    device: str | None = None
    checked: bool = False
    skip_reason: str | None = None
    flops: float | None = None
    duration_ns: int | None = None
    kind: str | None = None  # "elementwise" | "reduction" | "matmul" | "normalization" | "discrete" | "copy"
    calls: int = 1  # >1 for an aggregated row of calls skipped by sampling, filters or budget
    check_ns: int | None = None  # time spent checking this call (oracle, metrics)
    region: str = "eager_op"  # "eager_op" | "compiled_graph" (a whole torch.compile graph) | "compiled_node"
    graph_id: str | None = None  # Dynamo compile id ("0/1") of a compiled_graph / compiled_node row
    fx_node: str | None = None  # FX node name of a compiled_node row


@dataclass(frozen=True)
class OpDiff:
    """Error metrics of one op output against the CPU float64 oracle."""

    TABLE: ClassVar[str] = "op_diffs"

    run_id: str
    seq: int
    output_index: int
    verdict: str  # "pass" | "fail" | "overflow" | "scaled_overflow" | "expected_precision" | "skip"
    role: str | None = None  # "originator" | "propagator" | None
    dtype: str | None = None
    numel: int | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    mean_abs: float | None = None
    rmse: float | None = None
    cosine: float | None = None
    max_ulp: float | None = None
    mean_ulp: float | None = None
    scaled_error: float | None = None
    ref_scaled_error: float | None = None  # CPU at the device dtype vs the oracle
    propagated_error: float | None = None
    threshold: float | None = None
    nan_device: int | None = None
    inf_device: int | None = None
    nan_oracle: int | None = None
    inf_oracle: int | None = None
    mismatch_rate: float | None = None
    note: str | None = None
    skip_reason: str | None = None  # why this output was not compared (verdict "skip")
    emulated_error: float | None = None  # scaled error of an emulated bf16/TF32-input matmul vs the oracle
    precision: str | None = None  # active precision on matmul/conv outputs (JSON)
    repro_path: str | None = None  # saved inputs of a divergent op (tpudiag repro)
    ref_rmse: float | None = None  # compiled graphs/nodes: RMSE of eager at the device dtype vs float64


@dataclass(frozen=True)
class CompileEvent:
    """A compilation, cache lookup, recompile or graph break."""

    TABLE: ClassVar[str] = "compile_events"

    run_id: str
    seq: int
    # "compile" | "recompile" | "backward_compile" | "graph_break" | "cache" | "tpu_eager" | "tpu_graph" |
    # "tpu_stats" (see tpudiag.analysis.compile_events for what each one carries)
    kind: str
    ts_ns: int | None = None
    rank: int = 0
    frame_id: int | None = None
    compile_id: str | None = None
    attempt: int | None = None
    function: str | None = None
    file: str | None = None
    line: int | None = None
    cache_tier: str | None = None
    cache_hit: bool | None = None
    reason: str | None = None
    duration_s: float | None = None
    shapes: str | None = None
    payload: str | None = None  # JSON
    failed: bool = False  # the compilation (Dynamo frame, backend, TorchTPU executable) failed


# -- Long runs (issue 21): the pulse and the trace windows.  Declared here, the current way (spool + store schema),
# -- until collectors declare their own tables (the capture-session work); nothing else in this file depends on them.
@dataclass(frozen=True)
class PulseStep:
    """One step of the always-on pulse (every step of the run, whatever else is pruned): a training step, or in a
    job without an optimizer step (serving, generation, evaluation) a root module call (collectors/root_steps.py)."""

    TABLE: ClassVar[str] = "pulse"

    run_id: str
    step: int  # 0-based, counted at optimizer steps (else at root calls: collectors/root_steps.py)
    start_ns: int  # epoch nanoseconds: the step's first root-module forward (else the previous step's end)
    dur_ns: int  # start to the end of the optimizer step (else to the root call that began the next step)
    gap_ns: int | None = None  # previous step's end to this step's start (data wait, logging, evaluation...)
    own_ns: int = 0  # tpudiag's own time inside this step's hooks
    rank: int = 0
    shapes: str | None = None  # JSON: the root module's input shapes
    compiles: int = 0  # compile events in this step (compile collector)
    recompiles: int = 0
    graph_breaks: int = 0
    nonfinite: bool | None = None  # a non-finite gradient seen in this step; None: not known (never read)
    window_id: int | None = None  # the trace window this step ran in, if any
    figures: str | None = None  # JSON of the per-step probes' figures (e.g. memory); unknown figures are null


@dataclass(frozen=True)
class TraceWindow:
    """A whole profiler session of a few steps, and why it was opened."""

    TABLE: ClassVar[str] = "trace_windows"

    run_id: str
    window_id: int
    # "first_steps" | "schedule" | "slow_step" | "recompile" | "graph_break" | "nonfinite" | "memory" |
    # "numerics" | "manual" | "whole_run" (--trace all)
    reason: str
    first_step: int | None
    last_step: int | None
    start_ns: int
    end_ns: int
    trace_events: int = 0
    first_event_id: int = 0
    rank: int = 0
    detail: str | None = None  # what triggered it (e.g. "step 812 took 41.2 ms, 11.3x the median")
    numerics: bool = False  # numerics fully on for its steps (within --budget)
    path: str | None = None  # its Chrome trace in the run folder (None once pruned by --max-disk)
    pruned: bool = False


# -- memory collector tables (issue 22) ----------------------------------------------------------------------------
# One marked place so they can move to the collector's own table declarations (CaptureSession) later.
@dataclass(frozen=True)
class MemoryStep:
    """Memory figures of one step.  ``origin`` "sampler": read at the step's end from the backend (allocator, libtpu,
    /proc); "profiler": from the profiler's allocator events inside the step.  Unknown figures are None, never 0."""

    TABLE: ClassVar[str] = "memory_steps"

    run_id: str
    step: int
    origin: str  # "sampler" | "profiler"
    ts_ns: int | None = None
    device: str | None = None  # "cuda:0" | "tpu:0" | "cpu"
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_bytes: int | None = None
    rss_bytes: int | None = None
    device_used_bytes: int | None = None  # whole-device usage (libtpu hbm_capacity_usage), not just the allocator's
    limit_bytes: int | None = None
    sources: str | None = None  # JSON {figure: source}, e.g. {"peak_bytes": "torch.cuda.max_memory_allocated"}
    rank: int = 0


@dataclass(frozen=True)
class MemoryBlock:
    """Bytes held by one (module, op, shapes) group: ``kind`` "at_peak" (live at the window's peak), "at_oom" (live
    when the failing op started) or "top_alloc" (one of the largest single allocations)."""

    TABLE: ClassVar[str] = "memory_blocks"

    run_id: str
    window_id: int  # the trace chunk (profiler session) it came from
    kind: str
    bytes: int
    method: str  # "profiler" (Kineto memory events) | "dispatch" (live tensor bytes counted at dispatch)
    count: int = 1
    device: str | None = None
    module: str | None = None
    op: str | None = None
    shapes: str | None = None
    step: int | None = None
    ts_ns: int | None = None
    rank: int = 0


@dataclass(frozen=True)
class MemoryPoint:
    """Live bytes over a window (downsampled: at most a few thousand points a window, the peak always kept)."""

    TABLE: ClassVar[str] = "memory_timeline"

    run_id: str
    window_id: int
    ts_ns: int
    allocated_bytes: int
    method: str
    reserved_bytes: int | None = None
    device: str | None = None
    step: int | None = None
    rank: int = 0


@dataclass(frozen=True)
class MemoryOom:
    """The out-of-memory error that ended the script."""

    TABLE: ClassVar[str] = "memory_oom"

    run_id: str
    kind: str  # "torch_oom" | "cpu_alloc" | "xla_hbm" | "xla_resource"
    message: str
    phase: str | None = None  # "compile" | "runtime" | None (not said)
    step: int | None = None
    module: str | None = None
    op: str | None = None
    requested_bytes: int | None = None
    live_bytes: int | None = None
    limit_bytes: int | None = None
    last_good_peak_bytes: int | None = None
    memory_space: str | None = None  # XLA: "hbm" | "vmem" | "smem" | "host"
    exception: str | None = None  # the exception's type name
    op_source: str | None = None  # how ``op`` was found: "profiler" | None
    rank: int = 0


@dataclass(frozen=True)
class MemoryOomAlloc:
    """One row of XLA's "Largest program allocations" table in an out-of-memory message."""

    TABLE: ClassVar[str] = "memory_oom_allocs"

    run_id: str
    position: int  # its number in XLA's table (1 = largest)
    size_bytes: int | None = None
    shape: str | None = None
    operator: str | None = None
    unpadded_bytes: int | None = None
    padding_bytes: int | None = None
    expansion: float | None = None
    xla_label: str | None = None
    allocation_type: str | None = None
    rank: int = 0


MEMORY_RECORDS: tuple[type[Any], ...] = (MemoryStep, MemoryBlock, MemoryPoint, MemoryOom, MemoryOomAlloc)
# -- end of the memory collector tables ----------------------------------------------------------------------------


RECORD_TYPES: tuple[type[Any], ...] = (
    Run, TraceEvent, Step, OpRecord, OpDiff, CompileEvent, *MEMORY_RECORDS, PulseStep, TraceWindow
)  # fmt: skip
BULK_TABLES: dict[str, type[Any]] = {c.TABLE: c for c in RECORD_TYPES if c is not Run}

# Tables a collector declares (``Collector.tables``): registered when the collector is loaded, so the spool and the
# rank shards accept them.  The store creates such a table from its first spooled part (not in the schema's DDL:
# a plugin's table never changes the schema version), and the distributed merge loads it like the built-ins.
_DECLARED: dict[str, type[Any]] = {}
_TABLE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,62}$")


def register_table(cls: type[Any]) -> None:
    """Accept ``cls`` (a frozen dataclass with ``TABLE`` and a ``run_id`` field) as a record type of the spool.

    Raises ValueError for a record type that cannot be a table, or a name a different record type already has."""
    name = getattr(cls, "TABLE", None)
    if not isinstance(name, str) or not _TABLE_NAME.match(name) or not dataclasses.is_dataclass(cls):
        raise ValueError(f"{cls.__name__}: a table's record type is a dataclass with TABLE = 'lower_snake_name'")
    if "run_id" not in {f.name for f in dataclasses.fields(cls)}:
        raise ValueError(f"{cls.__name__}: a table's record type needs a run_id field")
    known = BULK_TABLES.get(name) or _DECLARED.get(name)
    if name == Run.TABLE or name.startswith("dist_") or (known is not None and known is not cls):
        raise ValueError(f"{cls.__name__}: table name {name!r} is taken")
    _DECLARED[name] = cls


def bulk_tables() -> dict[str, type[Any]]:
    """Every table a spool accepts: the built-ins, then the ones collectors declared in this process."""
    return {**BULK_TABLES, **_DECLARED}


def is_table_name(name: str) -> bool:
    """A name safe to use as a table name in SQL (the store checks spool folder names with it)."""
    return bool(_TABLE_NAME.match(name))


def _column_kind(tp: Any) -> str:
    """A dataclass annotation -> "int" | "float" | "bool" | "str" (lists and dicts are stored as JSON text)."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _column_kind(inner[0])
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(tp, "str")


_KINDS: dict[type[Any], list[tuple[str, str]]] = {}


def column_kinds(cls: type[Any]) -> list[tuple[str, str]]:
    """(column name, kind) of a record type, in column order; the one mapping Arrow schemas and DDL derive from."""
    kinds = _KINDS.get(cls)
    if kinds is None:
        hints = typing.get_type_hints(cls)
        kinds = [(f.name, _column_kind(hints[f.name])) for f in dataclasses.fields(cls)]
        _KINDS[cls] = kinds
    return kinds


_SCHEMAS: dict[type[Any], pa.Schema] = {}


def arrow_schema(cls: type[Any]) -> pa.Schema:
    """The Arrow schema of a record type (cached: it is asked for on every spool write)."""
    import pyarrow as pa  # not at module level: opening a store or printing help never needs Arrow

    schema = _SCHEMAS.get(cls)
    if schema is None:
        types_ = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "str": pa.string()}
        schema = pa.schema([pa.field(name, types_[kind]) for name, kind in column_kinds(cls)])
        _SCHEMAS[cls] = schema
    return schema


def column_names(cls: type[Any]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def records_to_arrow(cls: type[Any], records: typing.Iterable[Any]) -> pa.Table:
    """Small-volume path: dataclass instances to an Arrow table."""
    names = column_names(cls)
    cols: dict[str, list[Any]] = {n: [] for n in names}
    for r in records:
        for n in names:
            cols[n].append(getattr(r, n))
    from tpudiag import arrow_columns  # (no pandas check: written from the script's own process)

    return arrow_columns.table(cols, arrow_schema(cls))
