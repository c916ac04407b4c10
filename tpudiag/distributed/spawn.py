"""Workers started by ``torch.multiprocessing.spawn`` inside a captured script are ranks of the same run.

``torch.multiprocessing.start_processes`` (behind ``spawn``) is wrapped while the script runs: the function each
worker runs becomes ``functools.partial(rank_entry, fn, config)``, which the child unpickles and calls as
``fn(i, *args)`` would be called, inside a rank capture session.  The rank is learned at ``init_process_group``
(nothing in the environment says it); a worker that never makes a group is rank ``i``.  Only processes started
through this API are ranks: DataLoader workers and compile workers are not.  ``start_method="fork"`` children
are left alone (a forked copy of a running profiler is not safe to use), with a note.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpudiag import runner
from tpudiag.distributed.identity import RankIdentity
from tpudiag.distributed.session import WorkerConfig, WorkerSession
from tpudiag.model import Run
from tpudiag.store import Store

if TYPE_CHECKING:
    import duckdb


def rank_entry(fn: Callable[..., Any], config_json: str, i: int, *args: Any) -> Any:
    """Runs in the spawned child: ``fn(i, *args)`` inside the rank's capture session; errors propagate as before."""
    config = WorkerConfig.from_env(config_json)
    identity = RankIdentity.from_env({k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")})
    identity.rank, identity.local_rank = None, i
    session = WorkerSession(config, identity)
    session.start()
    try:
        result = fn(i, *args)
    except SystemExit as exc:
        code = runner._exit_code_of(exc)
        session.finish("ok" if code == 0 else "failed", code, None if code == 0 else f"SystemExit({exc.code!r})", i)
        raise
    except KeyboardInterrupt:
        session.finish("interrupted", 130, "KeyboardInterrupt", i)
        raise
    except BaseException as exc:
        session.finish("failed", 1, f"{type(exc).__name__}: {exc}", i)
        raise
    session.finish("ok", 0, None, i)
    return result


class SpawnPatch:
    """Installed for the script's run; ``remove()`` puts torch's function back."""

    def __init__(self, config: WorkerConfig, note: Callable[[str], None]) -> None:
        self._config, self._note = config, note
        self._saved: list[tuple[Any, Any]] = []
        self.used = False  # the script started workers through it

    def install(self) -> None:
        import importlib

        tmp = importlib.import_module("torch.multiprocessing")
        spawn_module = importlib.import_module("torch.multiprocessing.spawn")  # the name `spawn` is the function

        original = spawn_module.start_processes
        config_json = self._config.to_env()
        note = self._note
        patch = self

        @functools.wraps(original)
        def start_processes(
            fn: Callable[..., Any],
            args: tuple[Any, ...] = (),
            nprocs: int = 1,
            join: bool = True,
            daemon: bool = False,
            start_method: str = "spawn",
        ) -> Any:
            patch.used = True
            if start_method == "fork":
                note("torch.multiprocessing workers started with start_method='fork' were not captured")
            else:
                fn = functools.partial(rank_entry, fn, config_json)
            return original(fn, args, nprocs, join, daemon, start_method)

        for owner in (spawn_module, tmp):
            if getattr(owner, "start_processes", None) is original:
                self._saved.append((owner, original))
                setattr(owner, "start_processes", start_processes)  # noqa: B010

    def remove(self) -> None:
        for owner, original in self._saved:
            setattr(owner, "start_processes", original)  # noqa: B010
        self._saved.clear()


def install(
    run_id: str,
    run_dir: str,
    collect: list[str] | None,
    options: dict[str, Any],
    flush_s: float,
    note: Callable[[str], None],
) -> SpawnPatch | None:
    """Wrap torch's process starter when torch is already loaded (the collectors load it); never raises."""
    import sys

    if "torch" not in sys.modules:
        return None
    try:
        patch = SpawnPatch(WorkerConfig(run_id, run_dir, collect, dict(options), flush_s), note)
        patch.install()
    except Exception as err:
        note(f"torch.multiprocessing workers will not be captured ({err})")
        return None
    return patch


def merge_ranks(store: Store, run: Run, run_dir: Path) -> Run:
    """The spawned ranks' shards into the run's ``dist_*`` tables.

    The run's own tables keep the parent process's data, relabelled rank -1 (it is not a rank of the job).
    """
    from tpudiag.distributed import merge  # here: the wrapper is installed in every capture, before its script

    if not merge.has_shards(run_dir):
        return run
    from tpudiag.store import distributed_queries

    def finish(w: duckdb.DuckDBPyConnection) -> Run:
        distributed_queries.mark_parent_rows(w, run.id)
        return merge.finish(store, run, run_dir, con=w, main_tables=False)

    return merge.store_merged(store, run, finish)
