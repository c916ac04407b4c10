"""Records only distributed jobs produce: one per rank attempt, one per fingerprint, one per collective.

They follow the data model's conventions (frozen dataclasses, ``TABLE``, Arrow schemas from the fields), but live in
their own tables (``dist_*``), created by ``tpudiag.store.distributed_queries`` when a distributed run is stored, so
single-process stores and their schema version are untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class RankInfo:
    """One rank of one attempt: who it was and how it ended."""

    TABLE: ClassVar[str] = "dist_ranks"

    run_id: str
    rank: int
    restart: int = 0  # torchelastic's restart count: which attempt of the job
    local_rank: int | None = None
    world_size: int | None = None
    host: str | None = None
    pid: int | None = None
    backend: str | None = None
    status: str = "running"  # "ok" | "failed" | "interrupted" | "lost" (no record: killed)
    exit_code: int | None = None
    error: str | None = None  # the exception summary, or torchelastic's error file message
    started_at: float | None = None
    ended_at: float | None = None
    device: str | None = None  # e.g. "cpu", "cuda:1", "tpu"
    device_ids: str | None = None  # JSON: TorchTPU rank -> global device ids
    job_id: str | None = None  # TORCHELASTIC_RUN_ID / SLURM_JOB_ID
    artifacts_dir: str | None = None
    notes: str | None = None  # JSON list: what the rank's capture wants the user to know
    numerics_checked: int | None = None  # filled in at merge from the rank's op_diffs
    numerics_failures: int | None = None


@dataclass(frozen=True)
class Fingerprint:
    """A cheap fingerprint of the parameters (after) or gradients (before) an optimizer step on one rank."""

    TABLE: ClassVar[str] = "dist_fingerprints"

    run_id: str
    rank: int
    step: int
    kind: str  # "param" | "grad"
    fingerprint: str  # hex digest of the per-tensor sums, equal on ranks that hold the same numbers
    restart: int = 0  # torchelastic's restart count: which attempt of the job
    tensors: int = 0
    abs_sum: float | None = None  # sum of |x| over all tensors (how far apart two ranks are)


@dataclass(frozen=True)
class Collective:
    """One collective on one rank, in the order the rank ran them."""

    TABLE: ClassVar[str] = "dist_collectives"

    run_id: str
    rank: int
    seq: int  # index among this rank's collectives
    op: str  # "all_reduce", "broadcast", ...
    restart: int = 0  # torchelastic's restart count: which attempt of the job
    shapes: str | None = None  # JSON list of input dims
    dtypes: str | None = None  # JSON list of input types
    bytes: int | None = None
    start_ns: int | None = None
    dur_ns: int | None = None  # time inside the collective: waiting for peers plus the transfer


DIST_RECORDS: tuple[type[Any], ...] = (RankInfo, Fingerprint, Collective)
