"""The capture session of one rank: collectors and the distributed probe around the rank's own code.

It is the capture session (``tpudiag.session``) with a ``ShardSink``: a rank never opens DuckDB (hundreds of ranks
would queue on its one writer lock); it writes Parquet shards, which the launcher side merges into one run when the
job ends.  The launcher side hands the run over in one environment variable (``WorkerConfig``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpudiag import console, runner
from tpudiag.clock import Clock, SystemClock
from tpudiag.distributed import selection
from tpudiag.distributed.identity import RankIdentity
from tpudiag.distributed.probe import DistributedProbe
from tpudiag.distributed.records import RankInfo
from tpudiag.distributed.shards import ShardSpool
from tpudiag.model import Run
from tpudiag.plugins import CaptureContext, Collector, load_collectors
from tpudiag.runner import Outcome
from tpudiag.session import CaptureSession, Delivered, Finished

CONFIG_ENV = "TPUDIAG_DIST"
ORIGINAL_PYTHON_EXEC_ENV = "TPUDIAG_DIST_PYTHON_EXEC"


@dataclass
class WorkerConfig:
    run_id: str
    run_dir: str
    collect: list[str] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    flush_s: float = 10.0

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, raw: str) -> WorkerConfig:
        data = json.loads(raw)
        return cls(**{k: data[k] for k in ("run_id", "run_dir", "collect", "options", "flush_s") if k in data})

    @property
    def shards_root(self) -> Path:
        return Path(self.run_dir) / "shards"


def take_config_from_env() -> WorkerConfig | None:
    """This process's config, removed from the environment so the rank's own children do not see it."""
    raw = os.environ.pop(CONFIG_ENV, None)
    original = os.environ.pop(ORIGINAL_PYTHON_EXEC_ENV, None)
    if raw is not None:
        if original:
            os.environ["PYTHON_EXEC"] = original
        else:
            os.environ.pop("PYTHON_EXEC", None)
    try:
        return WorkerConfig.from_env(raw) if raw else None
    except (ValueError, TypeError, KeyError):
        return None


def error_file_message(path: str | None) -> str | None:
    """The message of torchelastic's error file (written by ``@record``), if the rank wrote one."""
    if not path or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        message = data.get("message")
        if isinstance(message, dict):
            message = message.get("message")
        return str(message).strip().splitlines()[-1] if message else None
    except (OSError, ValueError, AttributeError, IndexError):
        return None


class ShardSink:
    """A rank's sink: no store (hundreds of ranks would queue on DuckDB's one writer lock); the finished run becomes
    the rank's ``RankInfo`` record, written to its shards beside the collectors' parts."""

    def __init__(self, config: WorkerConfig, identity: RankIdentity, spool: ShardSpool, workdir: Path) -> None:
        self.config, self.identity, self.spool, self.workdir = config, identity, spool, workdir
        self.fallback_rank: int | None = None
        self.extra_notes: list[str] = []

    @property
    def defers(self) -> bool:
        return False

    def begin(self, run: Run) -> None:
        """The launcher registered the job's run."""

    def flush(self) -> None:
        """The collectors' parts are shards already."""

    def deliver(self, finished: Finished) -> Delivered:
        if self.spool.rank is None:
            self.spool.set_rank(self.fallback_rank if self.fallback_rank is not None else 0)
        self.identity.rank = self.spool.rank
        run, outcome = finished.run, finished.outcome
        # The rank's record keeps its error apart (not as a note): the cross-rank analysis reads it.
        notes = self.extra_notes + [n for n in run.notes if not n.startswith("script ended with ")]
        info = RankInfo(
            run_id=self.config.run_id,
            rank=self.spool.rank or 0,
            restart=self.identity.attempt,
            local_rank=self.identity.local_rank,
            world_size=self.identity.world_size,
            host=self.identity.host,
            pid=self.identity.pid,
            backend=self.identity.backend,
            status=outcome.status,
            exit_code=outcome.exit_code,
            error=error_file_message(os.environ.get("TORCHELASTIC_ERROR_FILE")) or outcome.error,
            started_at=run.started_at,
            ended_at=time.time(),
            device=run.device_kind,
            device_ids=json.dumps(self.identity.device_ids) if self.identity.device_ids else None,
            job_id=self.identity.job_id,
            artifacts_dir=str(self.workdir),
            notes=json.dumps(notes) if notes else None,
        )
        self.spool.write_records(RankInfo, [info])
        return Delivered(run, False)


class WorkerSession:
    """``start()`` before the rank's code, ``finish(...)`` after it; neither ever raises into the rank."""

    def __init__(self, config: WorkerConfig, identity: RankIdentity, clock: Clock | None = None) -> None:
        self.config, self.identity = config, identity
        self.clock = clock or SystemClock()
        run_dir = Path(config.run_dir)
        tag = f"a{identity.attempt}-{identity.pid}"
        self.spool = ShardSpool(
            config.shards_root, run_dir / "shards-staging" / tag, config.run_id, identity.rank, identity.attempt
        )
        self.workdir = run_dir / "workers" / tag
        self.sink = ShardSink(config, identity, self.spool, self.workdir)
        self.notes = self.sink.extra_notes  # what the rank's record says besides its collectors' notes
        self.probe: DistributedProbe | None = None
        self.session: CaptureSession | None = None

    @property
    def ctx(self) -> CaptureContext | None:
        return self.session.ctx if self.session is not None else None

    @property
    def active(self) -> list[Collector]:
        return self.session.active if self.session is not None else []

    def start(self) -> None:
        try:
            with runner.signals_to_main_thread():
                self._start()
        except Exception as err:
            self.notes.append(f"the rank's capture failed to start: {err}")

    def _start(self) -> None:
        options = dict(self.config.options)
        if options.pop("budget", None) is not None:
            # A time budget decides per rank from its own timings; every rank must check the same ops.
            self.notes.append("--budget is ignored in distributed jobs (it would decide differently on each rank)")
        # Until init_process_group says otherwise, a spawned worker's index stands in (TorchTPU's worker_rank).
        provisional = self.identity.rank if self.identity.rank is not None else self.identity.local_rank
        options["rank"] = provisional or 0
        console.set_rank(provisional or 0)  # tpudiag's stderr lines from this process say which rank wrote them
        self.workdir.mkdir(parents=True, exist_ok=True)
        collectors = load_collectors(self.config.collect)
        skip = selection.deselected(options, provisional or 0, self.identity.local_rank, self.identity.world_size)
        if skip:  # --trace-ranks / --numerics-ranks: the same rule on every rank, from the launcher's environment
            collectors = [c for c in collectors if c.name not in skip]
            self.notes.append(f"rank not selected for: {', '.join(sorted(skip))}")
        run = Run(
            id=self.config.run_id, name="rank", status="running", started_at=self.clock.wall(), pid=self.identity.pid
        )
        self.session = CaptureSession(
            run, self.workdir, self.spool, collectors, self.sink,
            options=options, clock=self.clock, flush_s=self.config.flush_s,
        )  # fmt: skip
        self.session.start()
        # The probe needs torch; it is loaded only when a collector already loaded it (``--collect none`` stays
        # torch-free, and its ranks are known from the launcher's environment only).
        if "torch" in sys.modules:
            try:
                self.probe = DistributedProbe(self.identity, self.spool, self._rank_known)
                self.probe.start()
                self.session.attach(_ProbePart(self.probe, self.notes))
            except Exception as err:
                self.probe = None
                self.notes.append(f"the distributed probe failed to start: {err}")

    def _rank_known(self, identity: RankIdentity) -> None:
        if identity.rank is not None:
            self.spool.set_rank(identity.rank)
            console.set_rank(identity.rank)
            if self.ctx is not None:
                self.ctx.options["rank"] = identity.rank

    def finish(self, status: str, exit_code: int | None, error: str | None, fallback_rank: int | None = None) -> None:
        with contextlib.suppress(Exception):
            self.sink.fallback_rank = fallback_rank
            outcome = Outcome(exit_code if exit_code is not None else 0, status, error)
            if self.session is None:  # the capture never started: the rank's record still says how it ended
                run = Run(id=self.config.run_id, name="rank", status=status, started_at=self.clock.wall())
                self.sink.deliver(Finished(run, outcome))
                return
            self.session.deliver(self.session.stop(outcome))


class _ProbePart:
    """The distributed probe as a part of the session: flushed with the collectors, stopped before them."""

    name = "distributed probe"

    def __init__(self, probe: DistributedProbe, notes: list[str]) -> None:
        self.probe, self.notes = probe, notes

    def flush(self) -> None:
        self.probe.flush()

    def stop(self) -> None:
        try:
            self.probe.stop()
        except Exception as err:
            self.notes.append(f"the distributed probe failed while stopping: {err}")
        self.notes += self.probe.errors
