"""``tpudiag capture -m torch.distributed.run ...`` (or ``tpudiag capture torchrun ...``): one run for the job.

The launcher (torchrun's elastic agent) runs in tpudiag's process exactly as ``python -m torch.distributed.run``
would run it, with no collector: only its workers are ranks.  Workers are reached through ``PYTHON_EXEC``, the
interpreter torchrun starts each worker with: it points at a shell wrapper in the run folder that runs
``python -u -m tpudiag.distributed.worker <torchrun's worker arguments>``.  That reaches exactly torchrun's own
children (a DataLoader worker or an Inductor compile worker is started with ``sys.executable`` and is not a
rank), survives ``--max-restarts`` (each attempt's workers are new children, with ``TORCHELASTIC_RESTART_COUNT``
telling the attempt) and needs no ``sitecustomize`` or ``.pth`` file.  Not reached: ``--run-path`` and
``--no-python`` workers (a note says so).  When the launcher returns, the ranks' shards are merged into the run,
and the launcher's exit status is the capture's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from pathlib import Path
from typing import Protocol

from tpudiag import forks, runner
from tpudiag.capture_options import CaptureOptions, CaptureResult
from tpudiag.clock import Clock, SystemClock
from tpudiag.distributed import merge, multinode
from tpudiag.distributed.run_id import derive_run_id
from tpudiag.distributed.session import WorkerConfig
from tpudiag.distributed.wrapper import worker_environment, write_wrapper
from tpudiag.errors import TpudiagError
from tpudiag.model import Run
from tpudiag.plugins import load_collectors
from tpudiag.run_setup import RunStart, new_run, prepare_run
from tpudiag.session import CaptureSession, Delivered, Finished
from tpudiag.spool import Spool
from tpudiag.store import Store
from tpudiag.store import distributed_queries as q
from tpudiag.store_access import open_store

UNREACHED_FLAGS = ("--run-path", "--run_path", "--no-python", "--no_python")


class JobSink:
    """The launcher's sink: the job's run stored with its ranks' shards merged in (or, on a node that is not the
    last of a multi-node job out, left ``running`` for the last one to merge)."""

    def __init__(self, store: Store, run_dir: Path, node: multinode.NodeMarker | None) -> None:
        self.store, self.run_dir, self.node = store, run_dir, node
        self.notes: list[str] = []

    @property
    def defers(self) -> bool:
        return False

    def begin(self, run: Run) -> None:
        if self.node is None:  # a node of a multi-node job joined or created the run already
            self.store.put_run(run)

    def flush(self) -> None:
        """Nothing to load while the job runs: the ranks write shards."""

    def deliver(self, finished: Finished) -> Delivered:
        final = finished.run
        if self.node is not None:
            still_running = self.node.leave(final.status, final.exit_code, final.notes)
            if still_running:  # another node's ranks are still at work: the last node out merges the job
                note = (
                    f"{len(still_running)} other node(s) of the job still running: the last one out merges every rank"
                )
                live = still_running[0]
                with self.store.writer() as w:  # the record points at a live node: stale-run recovery leaves it alone
                    q.set_run_owner(w, final.id, str(live.get("host")), int(live.get("pid") or 0))
                return Delivered(dataclasses.replace(final, status="running"), True, (note,))
            final = multinode.combine(final, self.node.outcomes())
        merged = merge.store_merged(self.store, final, lambda w: merge.finish(self.store, final, self.run_dir, con=w))
        return Delivered(merged, True)


class Upload(Protocol):
    """Where the node's run folder goes as its files become final (``tpudiag.remote.JobUpload`` for ``--remote``)."""

    def begin(self, run_dir: Path, run_id: str) -> str | None:
        """Start uploading; a note for the run when it could not (the job runs anyway)."""
        ...

    def end(self, run_dir: Path, run: Run) -> None:
        """The node's outcome is known: send the rest; never waits."""
        ...


def capture_launcher(
    target: runner.Target, options: CaptureOptions, clock: Clock | None = None, upload: Upload | None = None
) -> CaptureResult:
    clock = clock or SystemClock()
    runner.check_target(target)
    with runner.signals_to_main_thread():
        store = open_store(options.db)
        collectors = load_collectors(options.collect)  # unknown names fail here, before the job starts
        with contextlib.suppress(TpudiagError):
            store.recover_stale_runs()
    script = getattr(multinode.parse_launcher_args(target.args), "training_script", None)  # not a flag's value
    name = options.name or (Path(script).stem if script else "torchrun")
    start = RunStart(name, target.display, target.args, Path(script) if script else Path.cwd())
    job = derive_run_id(options.run_id, target.args)
    node: multinode.NodeMarker | None = None
    if job is None:
        run, run_dir = prepare_run(store, clock, start, collectors)
    else:  # one node of a multi-node job (or an explicit --run-id): create the job's run or join it
        run, _joined = multinode.join_or_create(store, job, new_run(store, clock, start, collectors))
        run_dir = Path(run.artifacts_dir or store.run_dir(run.id))
        run_dir.mkdir(parents=True, exist_ok=True)
        node = multinode.NodeMarker(run_dir)
        node.enter()
    # The launcher itself runs no collector: only its workers are ranks.
    sink = JobSink(store, run_dir, node)
    session = CaptureSession(
        run, run_dir, Spool(run_dir / "spool"), [], sink, clock=clock, ended_with="launcher", flush_s=0
    )
    session.start(flusher=False)
    if upload is not None:  # every node uploads under the job's id (this store may have moved it on to ID.2)
        trouble = upload.begin(run_dir, job or run.id)
        if trouble:
            session.note(trouble)
    if any(a.split("=", 1)[0] in UNREACHED_FLAGS for a in target.args):
        session.note("--run-path / --no-python workers do not start through PYTHON_EXEC: they were not captured")
    config = WorkerConfig(
        run_id=run.id,
        run_dir=str(run_dir),
        collect=options.collect,
        options=dict(options.collector_options),
        flush_s=options.flush_interval_s,
    )
    wrapper = write_wrapper(run_dir, os.environ.get("PYTHON_EXEC") or sys.executable, node.path.stem if node else "")
    with worker_environment(config, wrapper):
        outcome = runner.run(target)
    if forks.in_child():  # a child the launcher's script forked, run on to its end: exits as without tpudiag
        return CaptureResult(run.id, outcome.exit_code, outcome.status, [], session.ctx, False, forked_child=True)
    finished = session.stop(outcome)
    if upload is not None:  # the uploader sends the rest and the completion marker; nobody waits for it
        upload.end(run_dir, finished.run)
    delivered = session.deliver(finished)
    for note in delivered.notes:
        session.note(note)
    return CaptureResult(run.id, outcome.exit_code, delivered.run.status, [], session.ctx, True)
