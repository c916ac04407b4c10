"""``tpudiag dashboard --remote``: the pages on a run read straight from a bucket (Streamlit's AppTest on the view
store, file:// bucket; the same view read from a moto S3 server on loopback through s3fs must be identical), and
every page's numbers equal the same run gathered into a local store."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from streamlit.testing.v1 import AppTest

from bench.bench_distributed import write_job
from tests.conftest import run_tpudiag
from tests.remote_servers import s3_server
from tpudiag.distributed.report_section import build_section
from tpudiag.remote import location
from tpudiag.remote.gather import gather
from tpudiag.remote.uploader import UploadConfig, Uploader
from tpudiag.remote.view import view_store
from tpudiag.store import Store, queries
from tpudiag.store.dashboard_queries import ops

MAIN = Path(__file__).resolve().parents[1] / "app" / "main.py"
RANKS, EVENTS, RUN = 4, 200, "podview"


def _upload_job(tmp: Path, url: str) -> None:
    """A 4-rank job (trace events, steps, compile events, fingerprints) uploaded by two nodes of two ranks."""
    whole = tmp / "whole"
    if not whole.exists():
        write_job(whole, RUN, RANKS, EVENTS)
    for node in range(2):
        node_dir = tmp / f"{url.split(':')[0]}-node{node}"
        for table_dir in (whole / "shards").iterdir():
            for rank in (2 * node, 2 * node + 1):
                src = table_dir / f"run_id={RUN}" / f"rank={rank}"
                if src.is_dir():
                    shutil.copytree(src, node_dir / "shards" / table_dir.name / f"run_id={RUN}" / src.name)
        config = UploadConfig(url, RUN, f"host{node}-1", f"host{node}", os.getpid())
        config.save(node_dir)
        outcome = {"status": "ok", "exit_code": 0, "notes": [], "run": {"name": "job", "started_at": 1.0}}
        assert Uploader(node_dir, config, give_up_s=10).finish(outcome)


def _top(store: Store) -> list[dict[str, Any]]:
    return ops.load_slow_ops(store, RUN, "op", ops.OpFilter(), 10).top


@pytest.fixture(scope="module")
def views(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("remoteview")
    file_url = f"file://{tmp / 'bucket'}/pre"
    _upload_job(tmp, file_url)
    view, run = view_store(tmp / "v-file", location.parse(file_url), None)
    gathered = Store(tmp / "gathered.duckdb")
    gather(gathered, location.parse(file_url), RUN)
    with s3_server() as s3:
        old = dict(os.environ)
        os.environ.update(s3.env)
        try:
            _upload_job(tmp, "s3://pod/pre")
            s3_view, _ = view_store(tmp / "v-s3", location.parse("s3://pod/pre"), RUN)
        finally:
            os.environ.clear()
            os.environ.update(old)
    return {"view": view, "run": run, "gathered": gathered, "s3_view": s3_view, "url": file_url, "tmp": tmp}


def test_view_equals_the_gathered_run(views: dict[str, Any]) -> None:
    view, gathered, s3_view = views["view"], views["gathered"], views["s3_view"]
    vrun, grun = queries.resolve_run(view, RUN), queries.resolve_run(gathered, RUN)
    assert vrun is not None and grun is not None
    assert (vrun["status"], vrun["exit_code"]) == (grun["status"], grun["exit_code"]) == ("ok", 0)
    section = build_section(view, vrun)
    assert section is not None and section["world_size"] == RANKS
    assert section == build_section(gathered, grun) == build_section(s3_view, queries.resolve_run(s3_view, RUN))
    top = _top(view)
    assert top and top == _top(gathered) == _top(s3_view)
    assert {t["name"] for t in top} == {"aten::addmm", "aten::mm", "aten::relu"}
    with view.reader() as con:  # summaries only: the events stay in the bucket
        assert con.execute("SELECT count(*) FROM trace_events").fetchone() == (0,)
        steps = con.execute("SELECT count(*) FROM steps").fetchone()
    with gathered.reader() as con:
        assert steps == con.execute("SELECT count(*) FROM steps").fetchone()


def test_pages_on_the_remote_view(views: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPUDIAG_DB", str(views["view"].path))
    at = AppTest.from_file(str(MAIN), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert at.selectbox(key="run").value == RUN
    runs = [d.value for d in at.dataframe]
    assert any(RUN in str(frame.to_dict("records")) for frame in runs)
    at.switch_page("views/ranks.py").run()
    assert not at.exception, at.exception
    assert {m.label: m.value for m in at.metric}["World size"] == str(RANKS)
    ranks = next(d.value for d in at.dataframe if "collective_s" in d.value.columns)
    assert sorted(ranks["rank"].tolist()) == list(range(RANKS))
    at.switch_page("views/slow_ops.py").run()
    assert not at.exception, at.exception
    shown = next(d.value for d in at.dataframe if "share %" in d.value.columns)
    gathered = _top(views["gathered"])
    assert shown["op"].tolist() == [t["name"] for t in gathered][: len(shown)]
    assert shown["calls"].tolist() == [t["calls"] for t in gathered][: len(shown)]


def test_dashboard_remote_bad_input_is_one_line(views: dict[str, Any]) -> None:
    tmp = views["tmp"]
    for args, words in (
        (["--remote", f"file://{tmp}/nobucket"], "no tpudiag runs"),
        (["--remote", views["url"], "--run", "nosuch"], "no run nosuch"),
        (["--run", RUN], "--run picks a run of --remote"),
    ):
        res = run_tpudiag("dashboard", "--port", "0", *args, cwd=tmp)
        assert res.returncode != 0 and words in res.stderr, res.stderr
        assert "Traceback" not in res.stderr and res.stderr.strip().count("\n") <= 1, res.stderr


def test_view_keeps_a_crashed_node(views: dict[str, Any], tmp_path: Path) -> None:
    """A node with manifests but no completion marker: the view's run is interrupted and says which node."""
    bucket = tmp_path / "b"
    shutil.copytree(Path(views["url"][len("file://") :]).parent, bucket)
    for marker in bucket.rglob("complete.json"):
        if "host1-1" in str(marker):
            marker.unlink()
    _, run = view_store(tmp_path / "v", location.parse(f"file://{bucket}/pre"), RUN)
    assert run.status == "interrupted" and any("host1-1" in n for n in run.notes)
    assert dataclasses.asdict(run)["id"] == RUN
