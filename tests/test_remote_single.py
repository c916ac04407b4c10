"""``tpudiag capture --remote URL script.py``: one process uploaded as a one-node, one-rank job (real capture, real
uploader process, moto's S3 server on loopback through s3fs); ``gather`` and ``report --remote`` give the same run
as the local store; a bucket that is down changes nothing for the script."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import run_tpudiag
from tests.remote_servers import SECRET, s3_server
from tpudiag.distributed.report_section import build_section
from tpudiag.remote import wait
from tpudiag.store import Store, queries
from tpudiag.store.dashboard_queries import ops

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad(); loss.backward(); opt.step()
    print("loss", round(float(loss), 6))
    sys.exit(3)
    """
)


def _run_id(stderr: str) -> str:
    found = re.search(r"run (\S+) \(", stderr)
    assert found, stderr
    return found.group(1)


def _plain(tmp: Path, script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(script)], cwd=tmp, capture_output=True, text=True, timeout=120)


def test_single_process_uploads_as_one_rank_job(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = _plain(tmp_path, script)
    db = tmp_path / "local.duckdb"
    with s3_server() as s3:
        env = s3.env
        res = run_tpudiag("capture", "--db", str(db), "--remote", "s3://pod/one", str(script), cwd=tmp_path, env=env)
        assert (res.returncode, res.stdout) == (plain.returncode, plain.stdout) == (3, plain.stdout)
        rid = _run_id(res.stderr)
        store = Store(db)
        run_dir = store.run_dir(rid)
        assert wait(run_dir, 180) == "done", (run_dir / "upload" / "uploader.out").read_text()
        import s3fs

        objects = s3fs.S3FileSystem(skip_instance_cache=True).find("pod/one")
        shards = [o for o in objects if o.startswith(f"pod/one/shards/trace_events/run_id={rid}/node=")]
        assert shards and all("/rank=0/" in o for o in shards)
        assert any(o.startswith(f"pod/one/shards/dist_ranks/run_id={rid}/") for o in objects)
        assert any(o.startswith(f"pod/one/raw/run_id={rid}/") for o in objects)  # the raw traces too
        assert any(o.endswith("/complete.json") and f"run_id={rid}" in o for o in objects)
        remote = run_tpudiag("report", "--remote", "s3://pod/one", rid, "--json", cwd=tmp_path, env=env)
        assert remote.returncode == 0, remote.stderr
        gathered_db = tmp_path / "gathered.duckdb"
        got = run_tpudiag("gather", "s3://pod/one", "--run", rid, "--db", str(gathered_db), cwd=tmp_path, env=env)
        assert got.returncode == 0, got.stderr
        texts = [res.stdout, res.stderr, remote.stdout, remote.stderr, got.stdout, got.stderr]
    data = json.loads(remote.stdout)
    dist = data["distributed"]
    assert dist["world_size"] == 1 and [r["rank"] for r in dist["ranks"]] == [0]
    assert dist["ranks"][0]["status"] == "failed" and dist["ranks"][0]["exit_code"] == 3
    assert data["run"]["exit_code"] == 3
    gathered = Store(gathered_db)
    grun = queries.resolve_run(gathered, rid)
    assert grun is not None and grun["exit_code"] == 3 and grun["script"] == str(script)
    assert build_section(gathered, grun) == dist  # gathered and read in place: the same run
    local_top = ops.load_slow_ops(store, rid, "op", ops.OpFilter(), 20).top
    assert local_top and ops.load_slow_ops(gathered, rid, "op", ops.OpFilter(), 20).top == local_top
    for path in tmp_path.rglob("*"):
        if path.is_file() and path.stat().st_size < 5_000_000:
            assert SECRET.encode() not in path.read_bytes(), path
    assert not any(SECRET in t for t in texts)


def test_bucket_down_never_changes_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plain = _plain(tmp_path, script)
    db = tmp_path / "local.duckdb"
    with s3_server() as s3:
        s3.stop()
        env = {**s3.env, "TPUDIAG_UPLOAD_GIVE_UP_S": "3"}
        t0 = time.monotonic()
        res = run_tpudiag(
            "capture", "--db", str(db), "--wait", "--remote", "s3://pod/one", str(script), cwd=tmp_path, env=env
        )
        took = time.monotonic() - t0
        assert (res.returncode, res.stdout) == (plain.returncode, plain.stdout)
        rid = _run_id(res.stderr)
        run_dir = Store(db).run_dir(rid)
        assert wait(run_dir, 120) == "pending"  # the uploader gave up later, on its own
        assert took < 60 and "Traceback" not in res.stderr
        runs = run_tpudiag("runs", "--db", str(db), cwd=tmp_path, env=env)
        assert "not uploaded" in runs.stdout + runs.stderr, runs.stdout
        s3.start()
        retry = run_tpudiag("upload", rid, "--db", str(db), cwd=tmp_path, env=env)
        assert retry.returncode == 0, retry.stderr
        remote = run_tpudiag("report", "--remote", "s3://pod/one", rid, "--json", cwd=tmp_path, env=env)
        assert json.loads(remote.stdout)["distributed"]["world_size"] == 1
