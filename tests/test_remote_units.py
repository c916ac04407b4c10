"""``tpudiag.remote`` on hand-built run folders: URL checks, the run id every host derives, rank selection, the
uploader's object layout (file:// bucket), manifests as the only thing a reader trusts, gather's incremental
merge, give-up and retry, and credentials that never leave the environment."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tpudiag
from tests.factories import make_run
from tests.remote_servers import SECRET, s3_server
from tpudiag.distributed import selection
from tpudiag.distributed.records import RankInfo
from tpudiag.distributed.run_id import derive_run_id
from tpudiag.distributed.shards import ShardSpool
from tpudiag.errors import UsageError
from tpudiag.model import Step
from tpudiag.remote import layout, location
from tpudiag.remote.gather import gather
from tpudiag.remote.reader import remote_report
from tpudiag.remote.uploader import UploadConfig, Uploader
from tpudiag.store import Store, queries


def test_parse_refuses_credentials_without_echoing_them() -> None:
    assert location.parse("gs://b/p/q/").path("x") == "b/p/q/x"
    assert location.parse("s3://b").uri("shards", "t") == "s3://b/shards/t"
    with pytest.raises(UsageError) as err:
        location.parse(f"s3://AKIAX:{SECRET}@bucket/p")
    assert SECRET not in str(err.value) and "environment" in str(err.value)
    with pytest.raises(UsageError) as err:
        location.parse(f"gs://bucket/p?token={SECRET}")
    assert SECRET not in str(err.value)
    for bad in ("http://x/y", "bucket/p", "s3://"):
        with pytest.raises(UsageError):
            location.parse(bad)


def test_redact_blanks_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    text = location.redact(f"denied {SECRET} at https://h/o?X-Amz-Signature=abc123&X-Amz-Credential=AK%2F1")
    assert SECRET not in text and "abc123" not in text and "AK%2F1" not in text


def test_capture_remote_errors_are_one_line_without_the_secret(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    db = str(tmp_path / "s.duckdb")
    for args in (
        ["--remote", f"s3://AKIA:{SECRET}@b/p", "torchrun", "--nproc-per-node", "1", str(script)],
        ["--remote", "http://bucket/x", str(script)],  # not a bucket URL (one process is fine: a one-rank job)
        ["--trace-ranks", "0,bogus", "torchrun", "--nproc-per-node", "1", str(script)],
    ):
        res = run_tpudiag("capture", "--db", db, *args, cwd=tmp_path)
        assert res.returncode != 0 and "hi" not in res.stdout
        assert res.stderr.strip().count("\n") == 0 and "Traceback" not in res.stderr, res.stderr
        assert SECRET not in res.stderr + res.stdout


def test_run_id_every_host_derives_alone() -> None:
    args = ["--nnodes", "2", "--rdzv-id", "rdzv7", "t.py"]
    env = {"TORCH_TPU_XPROF_SESSION_ID": "1733130000123", "TORCHELASTIC_RUN_ID": "elastic"}
    assert derive_run_id("mine", args, env) == "mine"
    assert derive_run_id(None, args, env) == "1733130000123"
    assert derive_run_id(None, args, {"TORCHELASTIC_RUN_ID": "elastic"}) == "rdzv7"
    assert derive_run_id(None, ["t.py"], {"TORCHELASTIC_RUN_ID": "el/1"}) == "el-1"
    assert derive_run_id(None, ["t.py"], {}) is None
    # Two launchers on one host never share a node key.
    assert layout.node_key("h", 1) != layout.node_key("h", 2)


def test_rank_selection_is_the_same_rule_everywhere() -> None:
    spec = selection.parse("0,last,first-per-host,5-6")
    world, per_host = 16, 4
    chosen = [r for r in range(world) if (r, r % per_host, world) in spec]
    assert chosen == [0, 4, 5, 6, 8, 12, 15]
    opts = {"trace_ranks": "0", "numerics_ranks": "last"}
    assert selection.deselected(opts, 0, 0, 4) == {"numerics"}
    assert selection.deselected(opts, 3, 3, 4) == {"trace"}
    assert selection.deselected({}, 3, 3, 4) == set()
    with pytest.raises(UsageError):
        selection.parse("first")


def _node_run(run_dir: Path, run_id: str, ranks: list[int], host: str = "hostA") -> None:
    """A node's run folder as a finished launcher leaves it: shards of its ranks and one XPlane per rank."""
    for rank in ranks:
        work = run_dir / "workers" / f"a0-{100 + rank}"
        (work / "plugins" / "profile" / "2026_12_02_10_00_00").mkdir(parents=True)
        (work / "plugins" / "profile" / "2026_12_02_10_00_00" / f"{host}_{rank}.xplane.pb").write_bytes(b"x" * rank)
        spool = ShardSpool(run_dir / "shards", run_dir / "staging", run_id, rank, 0)
        steps = [Step(run_id, s, s * 1000, 900 + rank * 10, "profiler_step", rank=rank) for s in range(3)]
        spool.write_records(Step, steps)
        info = RankInfo(
            run_id, rank, world_size=4, host=host, pid=100 + rank, status="ok", exit_code=0,
            artifacts_dir=str(work),
        )  # fmt: skip
        spool.write_records(RankInfo, [info])


def _upload(run_dir: Path, url: str, run_id: str, node: str, done: bool = True) -> Uploader:
    config = UploadConfig(url=url, run_id=run_id, node=node, host="hostA", launcher_pid=os.getpid())
    config.save(run_dir)
    up = Uploader(run_dir, config, give_up_s=5)
    outcome = {"status": "ok", "exit_code": 0, "notes": [], "run": {"name": "job", "started_at": 1.0}}
    assert up.finish(outcome if done else None)
    return up


def test_uploader_layout_and_write_once(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}/pre"
    run_dir = tmp_path / "node" / "run"
    _node_run(run_dir, "localid", [0, 1])
    up = _upload(run_dir, url, "job1", "hostA-11")
    objects = sorted(str(p.relative_to(bucket / "pre")) for p in bucket.rglob("*") if p.is_file())
    assert (
        "shards/steps/run_id=job1/node=hostA-11/rank=1/"
        + sorted(p.name for p in (run_dir / "shards" / "steps").rglob("*.parquet") if "rank=1" in str(p))[0]
        in objects
    )
    assert "plugins/profile/session_job1/hostA_0.xplane.pb" in objects  # XProf's own multi-host layout
    assert (bucket / "pre/plugins/profile/session_job1/hostA_1.xplane.pb").read_bytes() == b"x"
    assert any(o.startswith("raw/run_id=job1/node=hostA-11/workers/a0-100/") for o in objects)
    assert "manifests/run_id=job1/node=hostA-11/complete.json" in objects
    assert not any("shards-staging" in o or o.startswith("upload") for o in objects)
    manifests = [o for o in objects if "/manifest-" in o]
    # Again: nothing new to send, no object rewritten, no new manifest.
    mtimes = {p: p.stat().st_mtime_ns for p in bucket.rglob("*.parquet")}
    up2 = Uploader(run_dir, up.config)
    assert up2.send(up2.everything()) == 0
    assert {p: p.stat().st_mtime_ns for p in bucket.rglob("*.parquet")} == mtimes
    assert len([p for p in bucket.rglob("manifest-*.json")]) == len(manifests)


def test_gather_and_remote_report_read_only_listed_objects(tmp_path: Path) -> None:
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    _node_run(a, "job2", [0, 1], host="same")
    _node_run(b, "job2", [2], host="same")  # same hostname, another launcher: another node key
    _upload(a, url, "job2", "same-1")
    _upload(b, url, "job2", "same-2", done=False)  # crashed before its completion marker
    # An object no manifest names (an upload cut short) is never read: garbage here would fail any reader.
    stray = bucket / "shards" / "steps" / "run_id=job2" / "node=same-2" / "rank=2" / "a0-cut.parquet"
    stray.write_bytes(b"PAR1 half")
    remote = location.parse(url)
    data = remote_report(remote, None)
    dist = data["distributed"]
    assert [(r["rank"], r["status"], r["steps"]) for r in dist["ranks"]] == [
        (0, "ok", 3), (1, "ok", 3), (2, "ok", 3), (3, "lost", 0),
    ]  # fmt: skip
    assert [(n["node"], n["finished"]) for n in data["nodes"]] == [("same-1", True), ("same-2", False)]
    assert data["run"]["status"] == "interrupted"
    store = Store(tmp_path / "g.duckdb")
    first = gather(store, remote, "job2")
    assert (first.downloaded, first.skipped, first.unfinished) == (6, 0, ["same-2"])
    again = gather(store, remote, None)  # incremental: nothing downloaded twice
    assert (again.downloaded, again.skipped) == (0, 6)
    from tpudiag.distributed.report_section import build_section

    run = queries.resolve_run(store, "job2")
    assert build_section(store, run) == dist  # gathered and read in place: the same section
    assert run["status"] == "interrupted" and any("same-2" in n for n in run["notes"])


def test_gather_raw_downloads_the_raw_files_on_demand_only(tmp_path: Path) -> None:
    """Shards always; the raw files (XPlanes, trace windows, repro bundles) only with ``raw=True`` (``gather
    --raw``), each node's under ``<run folder>/raw/<node>/`` as in its run folder, once."""
    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    _node_run(a, "job6", [0, 1])
    _node_run(b, "job6", [2, 3])
    (a / "repro").mkdir()
    (a / "repro" / "op-7.pt").write_bytes(b"bundle")
    _upload(a, url, "job6", "hostA-1")
    _upload(b, url, "job6", "hostB-2")
    remote = location.parse(url)
    store = Store(tmp_path / "g.duckdb")
    first = gather(store, remote, "job6")
    run_dir = store.run_dir("job6")
    assert first.raw_dir is None and not (run_dir / "raw").exists()  # not asked for: nothing raw downloaded
    second = gather(store, remote, "job6", raw=True)
    raw = run_dir / "raw"
    assert second.raw_dir == str(raw) and second.raw_downloaded > 0 and second.downloaded == 0
    xplane = "workers/a0-103/plugins/profile/2026_12_02_10_00_00/hostA_3.xplane.pb"
    assert (raw / "hostB-2" / xplane).read_bytes() == (b / xplane).read_bytes() == b"xxx"
    assert (raw / "hostA-1" / "repro" / "op-7.pt").read_bytes() == b"bundle"
    assert not (raw / "hostA-1" / "shards").exists()  # shards are the merge's, under shards/
    again = gather(store, remote, "job6", raw=True)
    assert (again.raw_downloaded, again.raw_skipped) == (0, second.raw_downloaded)
    out = run_tpudiag("gather", url, "--run", "job6", "--db", str(tmp_path / "g.duckdb"), "--raw")
    assert out.returncode == 0 and f"raw files: 0 downloaded, {second.raw_downloaded} already here" in out.stdout


def test_remote_report_reads_under_a_memory_limit_and_retries_past_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bucket's rows live in a database capped at ``reader.MEMORY_LIMITS[0]`` that spills to a temporary
    folder; a read that cannot fit (DuckDB's out-of-memory error) is read again under the next limit."""
    import duckdb

    from tpudiag.remote import reader

    bucket = tmp_path / "bucket"
    url = f"file://{bucket}"
    a = tmp_path / "a" / "run"
    _node_run(a, "job3", [0, 1], host="h")
    _upload(a, url, "job3", "h-1")
    remote = location.parse(url)
    unlimited = remote_report(remote, "job3")
    tried: list[tuple[str | None, str]] = []
    section = reader._section

    def spy(*args: Any) -> Any:
        limit, spill = args[4], args[5]
        try:
            result = section(*args)
        except duckdb.OutOfMemoryException:
            tried.append((limit, "out of memory"))
            raise
        tried.append((limit, "read"))
        assert Path(spill).is_dir() and Path(spill).parent == spills
        return result

    monkeypatch.setattr(reader, "_section", spy)
    monkeypatch.setattr(reader, "MEMORY_LIMITS", ("256KB", "64MB", None))
    spills = tmp_path / "tmp"
    spills.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spills))
    assert remote_report(remote, "job3") == unlimited
    assert tried == [("256KB", "out of memory"), ("64MB", "read")]  # the limit holds, the next one reads
    assert not any(spills.iterdir())  # the spill folder is gone
    monkeypatch.setenv("TPUDIAG_REMOTE_MEMORY", "lots")
    with pytest.raises(UsageError, match="TPUDIAG_REMOTE_MEMORY='lots'"):
        remote_report(remote, "job3")


def test_remote_report_numbers_collectives_in_rank_batches_as_a_local_merge_in_one_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bucket reader numbers each rank's collectives in batches of ranks (``RANK_BATCH``); the gathered run's
    local merge in one pass: the same section, collectives and straggler included."""
    from bench.bench_distributed import STRAGGLER, write_job
    from tpudiag.distributed.report_section import build_section
    from tpudiag.store import distributed_queries

    run_dir = tmp_path / "node" / "run"
    ranks = STRAGGLER + 3
    write_job(run_dir, "job5", ranks, 60)
    url = f"file://{tmp_path / 'bucket'}"
    _upload(run_dir, url, "job5", "hostA-1")
    monkeypatch.setattr(distributed_queries, "RANK_BATCH", 4)  # several batches, the last one short
    remote = location.parse(url)
    dist = remote_report(remote, "job5")["distributed"]
    store = Store(tmp_path / "g.duckdb")
    gather(store, remote, "job5")
    assert build_section(store, queries.resolve_run(store, "job5")) == dist
    assert [r["collectives"] for r in dist["ranks"]] == [12] * ranks  # one all-reduce per 5 events, every rank
    assert dist["stragglers"][0]["rank"] == STRAGGLER


@pytest.mark.timeout(180)
def test_give_up_listed_by_runs_then_upload_retries(tmp_path: Path) -> None:
    db = tmp_path / "s.duckdb"
    store = Store(db)
    run_dir = store.run_dir("r1")
    _node_run(run_dir, "r1", [0])
    store.put_run(make_run(id="r1", artifacts_dir=str(run_dir)))
    with s3_server() as s3:
        env = s3.env
        config = UploadConfig(url="s3://pod/gu", run_id="r1", node="n1", host="h", launcher_pid=os.getpid())
        config.save(run_dir)
        (run_dir / "upload" / "events").mkdir(parents=True)
        (run_dir / "upload" / "events" / "end.json").write_text(json.dumps({"status": "ok", "exit_code": 0}))
        s3.stop()
        assert Uploader(run_dir, config, give_up_s=1).finish({"status": "ok", "exit_code": 0}) is False
        runs = run_tpudiag("runs", "--db", str(db), cwd=tmp_path, env=env)
        assert runs.returncode == 0 and "not uploaded to s3://pod/gu (retry: tpudiag upload r1)" in runs.stdout
        listed = json.loads(run_tpudiag("runs", "--db", str(db), "--json", cwd=tmp_path, env=env).stdout)
        assert len(listed[0]["not_uploaded"]["files"]) >= 2
        log = (run_dir / "upload" / "uploader.log").read_text()
        s3.start()
        retry = run_tpudiag("upload", "r1", "--db", str(db), cwd=tmp_path, env=env)
        assert retry.returncode == 0, retry.stderr
        runs2 = run_tpudiag("runs", "--db", str(db), cwd=tmp_path, env=env)
        assert "not uploaded" not in runs2.stdout
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        assert fs.exists("pod/gu/manifests/run_id=r1/node=n1/complete.json")
        assert fs.exists("pod/gu/plugins/profile/session_r1/hostA_0.xplane.pb")
    texts = [runs.stdout, runs.stderr, retry.stdout, retry.stderr, log]
    assert not [t for t in texts if SECRET in t]
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]


def test_uploader_process_never_needs_the_job(tmp_path: Path) -> None:
    """``begin`` starts a process of its own; ``end`` only drops a file: the caller never waits."""
    from tpudiag import remote

    run_dir = tmp_path / "run"
    _node_run(run_dir, "r2", [0])
    bucket = tmp_path / "bucket"
    env_before = dict(os.environ)
    config = remote.begin(f"file://{bucket}", run_dir, "r2", node="n")
    remote.files_ready(run_dir)
    remote.end(run_dir, make_run(id="r2", status="ok"))
    assert dict(os.environ) == env_before
    assert remote.wait(run_dir, 60) == "done"
    pid = int((run_dir / "upload" / "uploader.pid").read_text())
    assert pid != os.getpid() and config.launcher_pid == os.getpid()
    complete = json.loads((bucket / "manifests/run_id=r2/node=n/complete.json").read_text())
    assert complete["status"] == "ok" and complete["run"]["env"] == {}
