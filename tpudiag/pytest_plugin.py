"""The pytest plugin (entry point ``pytest11``): opt in with ``pytest --tpudiag``.

* ``@pytest.mark.tpudiag(numerics="clean", max_recompiles=0, max_graph_breaks=0)``: the test runs under a capture
  and fails, as pytest's own assertions do, when the run breaks an expectation — what was allowed, what was seen,
  where (op, module, source line).  Without ``--tpudiag`` the marker does nothing.
* the ``tpudiag`` fixture: a handle on the test's capture with ``assert_numerics_clean()``,
  ``assert_no_recompiles()``, ``compare(baseline)`` (asserting ends the capture).  Without ``--tpudiag`` the
  handle is inactive and its assertions do nothing.

Runs land in ``--tpudiag-db`` or, by default, in a store of this process's own (so pytest-xdist workers never
share one); the terminal summary says where.  Nothing heavy is imported unless the flag is given.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

MARKER_KEYS = ("numerics", "max_recompiles", "max_graph_breaks")
DEFAULT_COLLECT = "numerics,compile"
_HANDLE = pytest.StashKey["Handle"]()
_RUNS = pytest.StashKey[list[str]]()
_STORES = pytest.StashKey[dict[str, list[str]]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tpudiag", "tpudiag: numerics and compile checks of tests")
    group.addoption("--tpudiag", action="store_true", help="capture tests marked tpudiag (and the tpudiag fixture)")
    group.addoption("--tpudiag-db", metavar="PATH", help="store for the tests' runs (default: one per process)")
    group.addoption(
        "--tpudiag-collect",
        metavar="NAMES",
        default=DEFAULT_COLLECT,
        help=f"collectors for the tests' captures (default {DEFAULT_COLLECT})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "tpudiag(numerics='clean', max_recompiles=N, max_graph_breaks=N): with --tpudiag, capture the test and fail "
        "it when numerics diverge or it recompiles / breaks graphs more than allowed",
    )
    config.stash[_RUNS] = []


def _enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("tpudiag", default=False))


def _store_path(config: pytest.Config) -> Path:
    explicit = config.getoption("tpudiag_db", default=None)
    if explicit:
        return Path(explicit)
    return Path(tempfile.gettempdir()) / f"tpudiag-pytest-{os.getpid()}" / "tpudiag.duckdb"


class Handle:
    """The capture of one test."""

    def __init__(self, config: pytest.Config, nodeid: str, active: bool) -> None:
        self.active = active
        self.nodeid = nodeid
        self._config = config
        self._cm: Any = None  # tpudiag.api.Capture
        self._cap: Any = None  # tpudiag.api.CapturedRun
        self._snapshot: Any = None

    # -- capture (the public API: tpudiag.capture) ------------------------------------------------------------
    def start(self) -> None:
        if not self.active or self._cm is not None:
            return
        from tpudiag.api import Capture

        collect = str(self._config.getoption("tpudiag_collect"))
        self._cm = Capture(name=self.nodeid, db=_store_path(self._config), collect=collect)
        self._store = self._cm.store
        self._cap = self._cm.__enter__()
        self._config.stash[_RUNS].append(self._cap.id)

    def stop(self, failed: bool = False) -> None:
        if self._cm is None or self._cap.record is not None:
            return
        if failed:
            self._cm.__exit__(RuntimeError, RuntimeError("test failed"), None)
        else:
            self._cm.__exit__(None, None, None)

    @property
    def run_id(self) -> str | None:
        return self._cap.id if self._cap is not None else None

    def snapshot(self) -> Any:
        """The test's run as a comparison snapshot (ends the capture)."""
        self.stop()
        if self._snapshot is None:
            from tpudiag.comparison.source import snapshot_of

            self._snapshot = snapshot_of(self._store, self._cap.id)
        return self._snapshot

    def _where(self) -> str:
        return f"run {self.run_id} in {self._store.path} (tpudiag report --db {self._store.path} {self.run_id})"

    # -- assertions -----------------------------------------------------------------------------------------------
    def assert_numerics_clean(self) -> None:
        if not self.active:
            return
        from tpudiag.comparison.compare import where

        snap = self.snapshot()
        bad = [n for n in snap.numerics or [] if n.get("divergent")]
        if bad:
            lines = [f"tpudiag: numerics not clean: allowed 0 divergent ops, seen {len(bad)}"]
            lines += [
                f"  {where(n['op'], n['module'], n['first_source'])} (max scaled error {n['max_scaled_error']:.3g})"
                for n in bad[:10]
            ]
            raise AssertionError("\n".join([*lines, "  " + self._where()]))

    def assert_no_recompiles(self, allowed: int = 0) -> None:
        if not self.active:
            return
        events = (self.snapshot().compile or {}).get("recompile_events") or []
        if len(events) > allowed:
            lines = [f"tpudiag: allowed at most {allowed} recompile(s), seen {len(events)}"]
            lines += [f"  {e['function']} at {e['file']}:{e['line']}: {e['reason']}" for e in events[:10]]
            raise AssertionError("\n".join([*lines, "  " + self._where()]))

    def assert_graph_breaks(self, allowed: int = 0) -> None:
        if not self.active:
            return
        comp = self.snapshot().compile or {}
        seen = int(comp.get("graph_breaks") or 0)
        if seen > allowed:
            sites = comp.get("graph_break_sites") or []
            lines = [f"tpudiag: allowed at most {allowed} graph break(s), seen {seen}", *(f"  {s}" for s in sites[:10])]
            raise AssertionError("\n".join([*lines, "  " + self._where()]))

    def compare(self, baseline: str) -> dict[str, Any] | None:
        """This test's run against a baseline (run id in the same store, or a snapshot file); None if inactive."""
        if not self.active:
            return None
        from tpudiag.comparison.compare import compare, findings
        from tpudiag.comparison.source import snapshot_of

        result = compare(snapshot_of(self._store, baseline), self.snapshot())
        result["findings"] = [f.to_dict() for f in findings(result)]
        return result

    def check_marker(self, kwargs: dict[str, Any]) -> None:
        unknown = set(kwargs) - set(MARKER_KEYS)
        if unknown:
            raise pytest.UsageError(f"tpudiag marker: unknown argument(s) {', '.join(sorted(unknown))}")
        if kwargs.get("numerics") not in (None, "clean"):
            raise pytest.UsageError("tpudiag marker: numerics= takes 'clean'")
        if kwargs.get("numerics") == "clean":
            self.assert_numerics_clean()
        if kwargs.get("max_recompiles") is not None:
            self.assert_no_recompiles(int(kwargs["max_recompiles"]))
        if kwargs.get("max_graph_breaks") is not None:
            self.assert_graph_breaks(int(kwargs["max_graph_breaks"]))


@pytest.fixture
def tpudiag(request: pytest.FixtureRequest) -> Iterator[Handle]:
    """A handle on this test's tpudiag capture (inactive without --tpudiag)."""
    handle = Handle(request.config, request.node.nodeid, _enabled(request.config))
    handle.start()
    request.node.stash[_HANDLE] = handle
    try:
        yield handle
    finally:
        handle.stop()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    marker = item.get_closest_marker("tpudiag")
    if marker is None or not _enabled(item.config):
        return (yield)
    handle = item.stash.get(_HANDLE, None)
    if handle is None:
        handle = Handle(item.config, item.nodeid, True)
        handle.start()
        item.stash[_HANDLE] = handle
    try:
        result = yield
    except BaseException:
        handle.stop(failed=True)
        raise
    failure = None
    try:
        handle.check_marker(dict(marker.kwargs))
    except AssertionError as err:
        failure = str(err)
    if failure is not None:  # outside the except block: pytest shows the message alone, as its own failures
        pytest.fail(failure, pytrace=False)
    return result


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On a pytest-xdist worker: hand the runs to the controller, which prints the summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        no_runs: list[str] = []
        runs = session.config.stash.get(_RUNS, no_runs)
        workeroutput["tpudiag_runs"] = list(runs)
        workeroutput["tpudiag_store"] = str(_store_path(session.config))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """pytest-xdist controller: collect each worker's runs (their stores are the workers' own unless --tpudiag-db)."""
    out = getattr(node, "workeroutput", None) or {}
    if out.get("tpudiag_runs"):
        node.config.stash.setdefault(_STORES, {}).setdefault(out["tpudiag_store"], []).extend(out["tpudiag_runs"])


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    no_stores: dict[str, list[str]] = {}
    no_runs: list[str] = []
    stores = {path: list(ids) for path, ids in config.stash.get(_STORES, no_stores).items()}
    runs = config.stash.get(_RUNS, no_runs)
    if runs:
        stores.setdefault(str(_store_path(config)), []).extend(runs)
    for path, ids in stores.items():
        terminalreporter.write_line(f"tpudiag: {len(ids)} run(s) stored in {path}")
