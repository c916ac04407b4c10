"""Collectors and exporters are plugins: tpudiag's own register through entry points in its pyproject.toml, and a
third-party distribution on ``sys.path`` (a throw-away dist-info folder here) adds its own the same way."""

from __future__ import annotations

import importlib.metadata
import json
import textwrap
from pathlib import Path

import duckdb

from tests.conftest import EXAMPLES, run_tpudiag

PLUGIN = textwrap.dedent('''
    """A third-party collector and exporter, as another package would ship them."""
    import threading
    from dataclasses import dataclass
    from typing import ClassVar

    from tpudiag.store import queries


    @dataclass(frozen=True)
    class AcmeSample:
        """A record type of the collector's own table."""

        TABLE: ClassVar[str] = "acme_samples"

        run_id: str
        phase: str
        value: float


    class AcmeCollector:
        name = "acme"
        description = "a third-party collector with a table of its own"
        tables = (AcmeSample,)

        def is_available(self):
            return True

        def prepare(self, ctx):
            self.ctx = ctx
            self.prepared = True

        def start(self, ctx):
            assert self.prepared
            # Started after the built-ins (default start order): the trace collector's profiler already runs.
            import torch.autograd.profiler as p

            self.profiler_on = p._is_profiler_enabled
            self.threads = threading.active_count()

        def flush(self):
            pass

        def stop(self):
            self.ctx.note(f"acme collector: profiler on at start {self.profiler_on}, run {self.ctx.run_id}")
            self.ctx.spool.write_records(AcmeSample, [AcmeSample(self.ctx.run_id, "stop", 1.0)])
            # Work for after the script's exit: in the detached store write, or here when the run is stored now.
            if not self.ctx.defer(self, {"value": 2.5}):
                self.finish(self.ctx, {"value": 2.5, "here": True})

        def finish(self, ctx, args):
            phase = "stop-inline" if args.get("here") else "deferred"
            ctx.spool.write_records(AcmeSample, [AcmeSample(ctx.run_id, phase, args["value"])])


    class Hijack:
        """Registered under a built-in's name: must never replace it."""

        name = "trace"

        def __init__(self):
            raise RuntimeError("a third-party plugin replaced the built-in trace collector")


    class AcmeExporter:
        name = "acme"
        description = "calls per op, one line each"

        def export(self, store, run, out_dir, options):
            ops = queries.slow_ops(store, run["id"], limit=1000)
            path = out_dir / "acme.txt"
            lines = [f"{o['name']}\\t{o['module']}\\t{o['calls']}" for o in ops]
            path.write_text(run["id"] + "\\n" + "\\n".join(sorted(lines)) + "\\n")
            return [path]
''')


def _plugin_dir(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    dist = site / "acme_tpudiag-1.0.dist-info"
    dist.mkdir(parents=True)
    (site / "acme_tpudiag.py").write_text(PLUGIN)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-tpudiag\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[tpudiag.collectors]\nacme = acme_tpudiag:AcmeCollector\ntrace = acme_tpudiag:Hijack\n\n"
        "[tpudiag.exporters]\nacme = acme_tpudiag:AcmeExporter\nparquet = acme_tpudiag:Hijack\n"
    )
    return site


def test_builtins_are_registered_as_entry_points_of_tpudiag_itself() -> None:
    eps = importlib.metadata.distribution("tpudiag").entry_points
    collectors = {ep.name: ep.value for ep in eps if ep.group == "tpudiag.collectors"}
    exporters = {ep.name: ep.value for ep in eps if ep.group == "tpudiag.exporters"}
    assert collectors == {
        "trace": "tpudiag.collectors.trace:TraceCollector",
        "compile": "tpudiag.collectors.compile:CompileCollector",
        "numerics": "tpudiag.collectors.numerics:NumericsCollector",
        "memory": "tpudiag.collectors.memory:MemoryCollector",
    }
    assert set(exporters) == {"tensorboard", "perfetto", "parquet"}
    # The core names no collector module: only the entry points do.
    core = Path(__file__).resolve().parents[1] / "tpudiag"
    for source in core.glob("*.py"):
        assert "tpudiag.collectors.trace" not in source.read_text(), source


def test_a_third_party_collector_and_exporter_are_loaded_and_used(tmp_path: Path) -> None:
    env = {"PYTHONPATH": str(_plugin_dir(tmp_path))}
    db = tmp_path / "store.duckdb"
    script = EXAMPLES / "train_mlp.py"
    # Without the distribution on the path the name is unknown.
    missing = run_tpudiag("capture", "--db", str(db), "--collect", "acme", str(script), cwd=tmp_path)
    assert missing.returncode == 2 and "unknown collector acme" in missing.stderr, missing.stderr

    proc = run_tpudiag(
        "capture", "--db", str(db), "--collect", "acme,trace", str(script), "--epochs", "1", cwd=tmp_path, env=env
    )
    assert proc.returncode == 0, proc.stderr
    rep = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path, env=env)
    data = json.loads(rep.stdout)
    run = data["run"]
    assert run["collectors"] == ["trace", "acme"]  # built-ins start first whatever order they are named in
    assert f"acme collector: profiler on at start True, run {run['id']}" in run["notes"]
    assert f"note: acme collector: profiler on at start True, run {run['id']}" in proc.stderr
    # Its own table: spooled, created in the store from its declared schema; its deferred job ran in the child
    # that stored the run (declared in run.json, not looked up by name).
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("SELECT run_id, phase, value FROM acme_samples ORDER BY phase").fetchall()
        types = dict(con.execute("SELECT column_name, data_type FROM information_schema.columns "
                                 "WHERE table_name = 'acme_samples'").fetchall())  # fmt: skip
    assert rows == [(run["id"], "deferred", 2.5), (run["id"], "stop", 1.0)]
    assert types == {"run_id": "VARCHAR", "phase": "VARCHAR", "value": "DOUBLE"}
    # Stored in this process (--wait): the collector is told it cannot defer and does the work in stop.
    waited = run_tpudiag(
        "capture", "--db", str(db), "--wait", "--collect", "acme", str(script), "--epochs", "1", cwd=tmp_path, env=env
    )
    assert waited.returncode == 0, waited.stderr
    with duckdb.connect(str(db), read_only=True) as con:
        phases = con.execute("SELECT phase FROM acme_samples WHERE run_id <> ? ORDER BY phase", [run["id"]]).fetchall()
    assert phases == [("stop",), ("stop-inline",)]

    # Every available collector by default: the built-ins (never the hijacked one) and the plugin.
    listed = run_tpudiag("capture", "--db", str(db), "--collect", "nope", str(script), cwd=tmp_path, env=env)
    assert "available: acme, compile, memory, numerics, trace" in listed.stderr, listed.stderr

    out = tmp_path / "acme-out"
    exp = run_tpudiag("export", "--db", str(db), run["id"], "--format", "acme", "--out", str(out), env=env)
    assert exp.returncode == 0, exp.stderr
    assert exp.stdout.strip() == str(out / "acme.txt")
    lines = (out / "acme.txt").read_text().splitlines()
    assert lines[0] == run["id"]
    top = run_tpudiag("report", "--db", str(db), "--json", "--top", "1000", run["id"], cwd=tmp_path, env=env)
    expected = sorted(f"{o['name']}\t{o['module']}\t{o['calls']}" for o in json.loads(top.stdout)["slow_ops"])
    assert lines[1:] == expected and len(expected) > 5
    # The third-party "parquet" entry cannot replace the built-in exporter.
    pq = run_tpudiag(
        "export", "--db", str(db), run["id"], "--format", "parquet", "--out", str(tmp_path / "pq"), env=env
    )
    assert pq.returncode == 0, pq.stderr
    assert (tmp_path / "pq" / "trace_events.parquet").is_file()
