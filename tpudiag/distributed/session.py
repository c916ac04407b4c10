"""The capture session of one rank: collectors and the distributed probe around the rank's own code.

It is the single-process capture (``tpudiag.capture``) without the store: a rank never opens DuckDB (hundreds of
ranks would queue on its one writer lock); it writes Parquet shards, which the launcher side merges into one run
when the job ends.  The launcher side hands the run over in one environment variable (``WorkerConfig``).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tpudiag import console, environment, runner
from tpudiag.clock import SystemClock
from tpudiag.distributed.identity import RankIdentity
from tpudiag.distributed.probe import DistributedProbe
from tpudiag.distributed.records import RankInfo
from tpudiag.distributed.shards import ShardSpool
from tpudiag.plugins import CaptureContext, Collector, load_collectors

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


class _Flusher(threading.Thread):
    def __init__(self, parts: list[Any], interval: float) -> None:
        super().__init__(name="tpudiag-rank-flusher", daemon=True)
        self._parts, self._interval = parts, interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self._interval):
            for part in self._parts:
                with contextlib.suppress(Exception):
                    part.flush()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


class WorkerSession:
    """``start()`` before the rank's code, ``finish(...)`` after it; neither ever raises into the rank."""

    def __init__(self, config: WorkerConfig, identity: RankIdentity) -> None:
        self.config, self.identity = config, identity
        run_dir = Path(config.run_dir)
        tag = f"a{identity.attempt}-{identity.pid}"
        self.spool = ShardSpool(
            config.shards_root, run_dir / "shards-staging" / tag, config.run_id, identity.rank, identity.attempt
        )
        self.workdir = run_dir / "workers" / tag
        self.started = time.time()
        self.active: list[Collector] = []
        self.notes: list[str] = []
        self.probe: DistributedProbe | None = None
        self._flusher: _Flusher | None = None
        self.ctx: CaptureContext | None = None

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
        self.ctx = CaptureContext(
            run_id=self.config.run_id, run_dir=self.workdir, spool=self.spool, options=options, clock=SystemClock()
        )
        collectors = load_collectors(self.config.collect)
        for c in collectors:
            try:
                c.prepare(self.ctx)
            except Exception as err:
                self.ctx.note(f"collector {c.name} failed to prepare: {err}")
        for c in collectors:
            try:
                c.start(self.ctx)
                self.active.append(c)
            except Exception as err:
                self.ctx.note(f"collector {c.name} failed to start: {err}")
        # The probe needs torch; it is loaded only when a collector already loaded it (``--collect none`` stays
        # torch-free, and its ranks are known from the launcher's environment only).
        if "torch" in sys.modules:
            try:
                self.probe = DistributedProbe(self.identity, self.spool, self._rank_known)
                self.probe.start()
            except Exception as err:
                self.probe = None
                self.notes.append(f"the distributed probe failed to start: {err}")
        parts: list[Any] = [*self.active, *([self.probe] if self.probe else [])]
        self._flusher = _Flusher(parts, self.config.flush_s)
        self._flusher.start()

    def _rank_known(self, identity: RankIdentity) -> None:
        if identity.rank is not None:
            self.spool.set_rank(identity.rank)
            console.set_rank(identity.rank)
            if self.ctx is not None:
                self.ctx.options["rank"] = identity.rank

    def finish(self, status: str, exit_code: int | None, error: str | None, fallback_rank: int | None = None) -> None:
        with contextlib.suppress(Exception):
            self._finish(status, exit_code, error, fallback_rank)

    def _finish(self, status: str, exit_code: int | None, error: str | None, fallback_rank: int | None) -> None:
        if self._flusher is not None:
            self._flusher.stop()
        if self.probe is not None:
            try:
                self.probe.stop()
            except Exception as err:
                self.notes.append(f"the distributed probe failed while stopping: {err}")
            self.notes += self.probe.errors
        for c in reversed(self.active):
            try:
                c.stop()
            except Exception as err:
                if self.ctx is not None:
                    self.ctx.note(f"collector {c.name} failed while stopping: {err}")
        if self.spool.rank is None:
            self.spool.set_rank(fallback_rank if fallback_rank is not None else 0)
        self.identity.rank = self.spool.rank
        kind, _ = environment.device()
        notes = self.notes + (list(self.ctx.notes) if self.ctx else [])
        info = RankInfo(
            run_id=self.config.run_id,
            rank=self.spool.rank or 0,
            restart=self.identity.attempt,
            local_rank=self.identity.local_rank,
            world_size=self.identity.world_size,
            host=self.identity.host,
            pid=self.identity.pid,
            backend=self.identity.backend,
            status=status,
            exit_code=exit_code,
            error=error_file_message(os.environ.get("TORCHELASTIC_ERROR_FILE")) or error,
            started_at=self.started,
            ended_at=time.time(),
            device=kind,
            device_ids=json.dumps(self.identity.device_ids) if self.identity.device_ids else None,
            job_id=self.identity.job_id,
            artifacts_dir=str(self.workdir),
            notes=json.dumps(notes) if notes else None,
        )
        self.spool.write_records(RankInfo, [info])
