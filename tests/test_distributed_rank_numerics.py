"""A numerics fault on one rank of a real 3-rank torchrun DDP job (gloo, CPU) reaches the report.

Only rank 2 computes ``tanh`` wrongly (a float32 kernel off by 3e-3, planted with ``torch.library``).  DDP averages
the gradients, so the parameter fingerprints agree on every rank; the fault is only in rank 2's op diffs.  The
report, the rank table, the Ranks page, ``check`` and ``repro`` must all name rank 2 and its op; the live stderr
lines of each rank say which rank wrote them.  One job, run once per module.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_plain_reference, run_tpudiag

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]  # a real 3-rank torchrun job
ENV = {"OMP_NUM_THREADS": "1", "TPUDIAG_FLUSH_S": "2"}

JOB = r"""
import sys, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 2:  # only rank 2 computes tanh wrongly (float32)
    lib = torch.library.Library("aten", "IMPL")
    def tanh_kernel(x):
        exact = torch.where(x.abs() > 20, x.sign(), torch.sinh(x) / torch.cosh(x))
        return exact * (1 + 3e-3) if x.dtype == torch.float32 else exact
    lib.impl("tanh", tanh_kernel, "CPU")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
for step in range(3):
    loss = model(data[step]).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    sys.stdout.write(f"rank {rank} step {step} loss {loss.item():.6f}\n")
dist.barrier()  # torch 2.13's gloo aborts ~6% of exits without it (plain runs too)
dist.destroy_process_group()
"""
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3", "job.py"]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("rank-fault")
    (folder / "job.py").write_text(textwrap.dedent(JOB))
    db = folder / "store.duckdb"
    captured = run_tpudiag("capture", "--db", str(db), "--collect", "trace,numerics", *TORCHRUN, cwd=folder, env=ENV)
    assert captured.returncode == 0, captured.stderr
    plain = run_plain_reference([sys.executable, *TORCHRUN], cwd=folder, env={**os.environ, **ENV})
    report = run_tpudiag("report", "--db", str(db), "--json")
    text = run_tpudiag("report", "--db", str(db))
    assert report.returncode == 0 and text.returncode == 0, report.stderr + text.stderr
    return {
        "folder": folder,
        "db": db,
        "captured": captured,
        "plain": plain,
        "report": json.loads(report.stdout),
        "text": text.stdout,
    }


def test_output_unchanged(job: dict[str, Any]) -> None:
    assert job["plain"].returncode == 0, job["plain"].stderr
    assert sorted(job["captured"].stdout.splitlines()) == sorted(job["plain"].stdout.splitlines())


def test_divergent_ops_carry_their_rank_and_the_first_is_rank_2s(job: dict[str, Any]) -> None:
    numerics = job["report"]["numerics"]
    first = numerics["first_divergence"]
    assert (first["rank"], first["op"], first["module"], first["verdict"]) == (2, "aten::tanh", "module.1", "fail")
    originators = [e for e in numerics["divergent_ops"] if e["role"] == "originator"]
    assert len(originators) == 3  # one tanh per step, all on rank 2
    assert {(e["rank"], e["op"]) for e in originators} == {(2, "aten::tanh")}
    ranks = numerics["ranks"]
    assert ranks["diverging"] == [2] and ranks["agreeing"] == [0, 1]
    assert ranks["text"].startswith("rank 2 only: aten::tanh in module.1 (forward), seq ")
    assert ranks["text"].endswith("ranks 0, 1 agree (no divergent op)")
    per_rank = {r["rank"]: r for r in ranks["per_rank"]}
    assert per_rank[2]["divergent"] == 3 and per_rank[0]["divergent"] == per_rank[1]["divergent"] == 0
    assert per_rank[0]["checked"] == per_rank[2]["checked"] > 0


def test_text_names_the_rank(job: dict[str, Any]) -> None:
    text = job["text"]
    assert "  across ranks: rank 2 only: aten::tanh in module.1 (forward)" in text
    assert "FIRST DIVERGENCE: rank 2: seq " in text
    assert "no divergent op among" not in text  # rank 0's clean verdict is not the run's
    # The fingerprints agree (DDP averaged the gradients); the line must not read as "all is well".
    assert "numerics across ranks: fingerprints agree" not in text
    assert "ops diverged from the oracle on rank 2 (see numerics)" in text


def test_rank_table_has_a_numerics_column(job: dict[str, Any]) -> None:
    rows = {r["rank"]: r for r in job["report"]["distributed"]["ranks"]}
    assert rows[2]["numerics_failures"] == 3 and rows[0]["numerics_failures"] == 0
    assert rows[0]["numerics_checked"] and rows[0]["numerics_checked"] == rows[2]["numerics_checked"]
    lines = job["text"].splitlines()
    header = next(ln for ln in lines if ln.strip().startswith("rank  status"))
    assert "numerics" in header
    table = {ln.split()[0]: ln for ln in lines[lines.index(header) + 1 : lines.index(header) + 4]}
    assert f"3 fail/{rows[2]['numerics_checked']}" in table["2"]
    assert f"ok/{rows[0]['numerics_checked']}" in table["0"]


def test_ranks_page_shows_numerics(job: dict[str, Any]) -> None:
    from tpudiag.app import ranks as page
    from tpudiag.store import Store, queries

    store = Store(job["db"])
    run = queries.resolve_run(store, job["report"]["run"]["id"])
    rows = {r["rank"]: r for r in page.rank_rows(job["report"]["distributed"])}
    assert rows[2]["numerics"].startswith("3 fail/") and rows[1]["numerics"].startswith("ok/")
    assert (page.rank_numerics_text(store, run) or "").startswith("rank 2 only: aten::tanh")


def test_check_counts_divergences_on_every_rank(job: dict[str, Any]) -> None:
    rules = job["folder"] / "numerics-only.toml"
    rules.write_text(
        "[tool.tpudiag.check]\n"
        + "".join(
            f'[[tool.tpudiag.check.rules]]\nmetric = "{m}"\nenabled = false\n'
            for m in ("compile.recompiles_after_warmup", "compile.new_graph_breaks", "steps.steady")
        )
    )
    run_id = job["report"]["run"]["id"]
    out = run_tpudiag("check", run_id, "--db", str(job["db"]), "--rules", str(rules))
    assert out.returncode == 1, out.stdout + out.stderr
    (fail,) = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert "numerics.new_divergent_ops" in fail and "aten::tanh in module.1" in fail
    compared = json.loads(run_tpudiag("compare", run_id, run_id, "--db", str(job["db"]), "--json").stdout)
    assert compared["numerics"]["divergent_ops_a"] == 1  # (aten::tanh, module.1), counted on rank 2


def test_live_lines_say_their_rank(job: dict[str, Any]) -> None:
    err = job["captured"].stderr.splitlines()
    assert any(ln.startswith("tpudiag[rank 2]: numerics: first divergence: aten::tanh") for ln in err), err
    closing = [ln for ln in err if "numerics: " in ln and " ops seen" in ln]
    assert sorted(ln.split(":")[0] for ln in closing) == [f"tpudiag[rank {r}]" for r in range(3)]


def test_repro_of_another_ranks_op(job: dict[str, Any], tmp_path: Path) -> None:
    first = job["report"]["numerics"]["first_divergence"]
    assert first["repro"].endswith(f"{first['seq']} --rank 2")
    run_id = job["report"]["run"]["id"]
    out = tmp_path / "bundle"
    made = run_tpudiag("repro", run_id, str(first["seq"]), "--rank", "2", "--db", str(job["db"]), "-o", str(out))
    assert made.returncode == 0, made.stderr
    assert (out / "inputs.pt").is_file() and "aten::tanh" in (out / "repro.py").read_text()
    wrong = run_tpudiag("repro", run_id, str(first["seq"]), "--rank", "1", "--db", str(job["db"]), "-o", str(out))
    assert wrong.returncode != 0 and "on rank 1" in wrong.stderr and "Traceback" not in wrong.stderr


def test_repro_of_a_rank_of_a_run_gathered_from_a_bucket(job: dict[str, Any], tmp_path: Path) -> None:
    """The job's run folder uploaded as one node of a pod; gathered elsewhere, rank 2's saved inputs are there
    only once ``gather --raw`` brought the node's files, and ``repro --rank 2`` finds them."""
    from tpudiag.remote.uploader import UploadConfig, Uploader
    from tpudiag.store import Store

    first = job["report"]["numerics"]["first_divergence"]
    run_id = job["report"]["run"]["id"]
    run_dir = Store(job["db"]).run_dir(run_id)
    url = f"file://{tmp_path / 'bucket'}"
    config = UploadConfig(url=url, run_id="pod1", node="hostA-1", host="hostA", launcher_pid=os.getpid())
    config.save(run_dir)
    assert Uploader(run_dir, config, give_up_s=10).finish({"status": "ok", "exit_code": 0, "notes": []})
    db = str(tmp_path / "gathered.duckdb")
    assert run_tpudiag("gather", url, "--run", "pod1", "--db", db).returncode == 0
    out = tmp_path / "bundle"
    args = ["repro", "pod1", str(first["seq"]), "--rank", "2", "--db", db, "-o", str(out)]
    workers = run_dir / "workers"
    workers.rename(run_dir / "workers.away")  # the node's own folders are not on this machine (put back below)
    try:
        missing = run_tpudiag(*args)
        assert missing.returncode != 0 and "Traceback" not in missing.stderr
        raw = run_tpudiag("gather", url, "--run", "pod1", "--db", db, "--raw")
        assert raw.returncode == 0 and "raw files:" in raw.stdout, raw.stderr
        made = run_tpudiag(*args)
    finally:
        (run_dir / "workers.away").rename(workers)
    assert made.returncode == 0, made.stderr
    assert (out / "inputs.pt").is_file() and "aten::tanh" in (out / "repro.py").read_text()
