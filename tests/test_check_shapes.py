"""`tpudiag check` on two real captures whose input shapes differ (issue 19, item 5).

A compiled model (real ``torch.compile``) is trained for 8 steps twice; in the second run the sequence length
changes from 8 to 12 at step 4, which is exactly what makes Dynamo recompile after warm-up.  The runs are not
comparable for timing (other input shapes: other work), but the count rules hold whatever the shapes: the gate
must fail on the recompile with its reason, read the timing rule as inconclusive with its reason, and never refuse
with "runs not comparable" (exit 2), as it did.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import run_tpudiag

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import os
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    VARY = os.environ.get("SEQ_VARIES") == "1"


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 32)
            self.fc2 = torch.nn.Linear(32, 4)

        def forward(self, x):  # FORWARD LINE
            return self.fc2(torch.relu(self.fc1(x)))


    model = torch.compile(Net(), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(8):
        seq = 12 if VARY and step >= 4 else 8  # variable sequence length: a recompile after warm-up
        x = torch.randn(2, seq, 16)
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
    print(f"loss {loss.item():.6f}")
    """
)
FORWARD_LINE = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if "# FORWARD LINE" in line)
REASON = "tensor 'x' size mismatch at index 1. expected 8, actual 12"


@dataclass
class Pair:
    root: Path
    db: Path

    def check(self, *args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
        proc = run_tpudiag(
            "check", "varied", "--baseline", "fixed", *args, "--db", str(self.db), cwd=self.root, env=env
        )
        return proc.returncode, proc.stdout, proc.stderr


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Pair:
    root = tmp_path_factory.mktemp("shapes")
    (root / "train.py").write_text(SCRIPT)
    db = root / "store.duckdb"
    for name, varies in (("fixed", "0"), ("varied", "1")):
        proc = run_tpudiag(
            "capture",
            "--db",
            str(db),
            "--name",
            name,
            "--collect",
            "trace,compile,numerics",
            "train.py",
            cwd=root,
            env={"SEQ_VARIES": varies, "TPUDIAG_WAIT": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith("loss ")
    return Pair(root, db)


def test_the_runs_differ_in_input_shapes_only(pair: Pair) -> None:
    proc = run_tpudiag("compare", "fixed", "varied", "--json", "--db", str(pair.db), cwd=pair.root)
    comp = json.loads(proc.stdout)["comparable"]
    shapes = next(d for d in comp["differences"] if d["field"] == "input_shapes")
    assert shapes["a"] == [[[2, 8, 16]]] and shapes["b"] == [[[2, 8, 16]], [[2, 12, 16]]]
    assert (
        comp["problems"] == comp["timing_problems"] == ["input shapes differ: step and op times measure different work"]
    )
    text = run_tpudiag("compare", "fixed", "varied", "--db", str(pair.db), cwd=pair.root).stdout
    assert "not comparable for timing: input shapes differ" in text


def test_recompile_fails_with_its_reason_and_timing_is_inconclusive(pair: Pair) -> None:
    code, out, err = pair.check()
    assert code == 1, out + err  # before: 2, "runs not comparable: input shapes differ"
    assert "not comparable" not in err
    lines = out.splitlines()
    (fail,) = [ln for ln in lines if ln.startswith("FAIL")]
    assert "compile.recompiles_after_warmup" in fail and "seen 1 (baseline 0)" in fail
    assert f"forward at train.py:{FORWARD_LINE}: {REASON}" in fail
    (undecided,) = [ln for ln in lines if ln.startswith("INCONCLUSIVE")]
    assert undecided.split()[1] == "steps.steady:"
    assert "inconclusive: input shapes differ: step and op times measure different work" in undecided
    assert next(ln for ln in lines if ln.startswith("PASS") and "numerics.new_divergent_ops" in ln)
    assert lines[-1].startswith("tpudiag check varied: FAILED (1 fail, 1 inconclusive, 2 pass")

    code, out, _ = pair.check("--json")
    data = json.loads(out)
    assert code == 1 and data["verdict"] == "failed"
    assert data["timing_not_comparable"] == ["input shapes differ: step and op times measure different work"]
    by = {o["metric"]: o for o in data["outcomes"]}
    rec = by["compile.recompiles_after_warmup"]
    assert rec["status"] == "fail" and rec["file"] == "train.py" and rec["line"] == FORWARD_LINE
    assert rec["where"].endswith(REASON)
    assert by["steps.steady"]["status"] == "inconclusive"
    assert by["steps.steady"]["reason"].startswith("input shapes differ")


def test_ci_outputs_say_inconclusive(pair: Pair, tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    code, out, _ = pair.check("--format", "github", env={"GITHUB_STEP_SUMMARY": str(summary)})
    assert code == 1
    annotations = out.splitlines()
    assert annotations[0].startswith(f"::error file=train.py,line={FORWARD_LINE},")
    assert (
        "title=steps.steady inconclusive::" in annotations[1] and "inconclusive: input shapes differ" in annotations[1]
    )
    md = summary.read_text()
    assert "**Inconclusive**: steps.steady: input shapes differ" in md
    assert "| fail | compile.recompiles_after_warmup |" in md and "| inconclusive | steps.steady |" in md


def test_allow_mismatch_still_times_them(pair: Pair) -> None:
    code, out, _ = pair.check("--allow-mismatch", "--json")
    data = json.loads(out)
    assert code == 1 and data["timing_not_comparable"] == []
    steady = next(o for o in data["outcomes"] if o["metric"] == "steps.steady")
    # 7 steady steps of a millisecond: one block each, so the timing rule itself cannot decide; its reason is then
    # the sample size, not the shapes.
    assert steady["status"] in ("pass", "inconclusive") and "input shapes" not in (steady["reason"] or "")
