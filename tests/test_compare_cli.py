"""`tpudiag compare` and `tpudiag check` on real captures.

One small training script is captured end to end (trace, numerics and compile collectors) in four variants into one
store.  The runs whose times are compared are captured at the same time and start their steps together (a start line in
the script), so they saw the same machine load: the
clean script twice and once with an op made slower (a ``torch.library`` kernel over ``aten::tanh`` that sleeps
3 ms per call).  Then one "broken" run with a float32-only fault in that op, a recompile after warm-up and a
graph break.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import run_tpudiag
from tpudiag.cli import main

SCRIPT = textwrap.dedent(
    """
    import os, time
    import torch

    torch.manual_seed(0)
    torch.set_num_threads(1)
    MODE = os.environ.get("TPUDIAG_TEST_MODE", "clean")
    if MODE in ("slow", "broken"):
        lib = torch.library.Library("aten", "IMPL")

        def tanh_kernel(x):
            exact = torch.where(x.abs() > 20, x.sign(), torch.sinh(x) / torch.cosh(x))
            if MODE == "slow":
                time.sleep(0.003)  # the op got slower: 3 ms more per call, same result
                return exact
            return exact * (1 + 3e-3) if x.dtype == torch.float32 else exact  # float32-only wrong kernel

        lib.impl("tanh", tanh_kernel, "CPU")


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(64, 128)
            self.fc2 = torch.nn.Linear(128, 64)
            self.head = torch.nn.Linear(64, 4)

        def forward(self, x):
            h = self.fc1(x)
            if MODE == "long":
                # The same 3 ms idle at the same point of the step, outside any op: after a sleep the CPU runs
                # cold (caches, clocks), every later op of the step measured ×1.7 slower in "slow" than in a run
                # without it.  Here both runs pay that alike, so only the op that changed differs.
                time.sleep(0.003)
            h = torch.tanh(h)  # TANH LINE
            h = torch.relu(self.fc2(h))
            return self.head(h)


    def post(t):
        y = t * 2
        torch._dynamo.graph_break()  # GRAPH BREAK LINE
        return y + 1


    # Only the broken variant compiles: a recompile after warm-up (new shape at step 10) and a graph break.
    post_c = torch.compile(post, backend="eager", dynamic=False) if MODE == "broken" else None
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 64)
    # Start line: the runs of one phase begin their steps together, once every one of them has finished importing,
    # so their timed steps overlap and see the same load (not one run's steps beside another's imports).
    here, phase = os.environ["TPUDIAG_TEST_NAME"], os.environ["TPUDIAG_TEST_PHASE"].split(",")
    open(f"ready.{here}", "w").close()
    deadline = time.monotonic() + 300
    while not all(os.path.exists(f"ready.{name}") for name in phase) and time.monotonic() < deadline:
        time.sleep(0.01)
    for step in range(int(os.environ["TPUDIAG_TEST_STEPS"])):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        if post_c is not None:
            post_c(torch.ones(8 if step >= 10 else 4))
    print(f"loss {loss.item():.6f}")
    """
)
TANH_LINE = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if "# TANH LINE" in line)
BREAK_LINE = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if "# GRAPH BREAK LINE" in line)
# Short runs (25 steps, a few ms of steady steps: too few for a step-time verdict) and a long pair (600 steps,
# enough blocks of steps for the op that got slower to be significant).
PHASES = (("clean_a", "clean_b", "broken"), ("long", "slow"))
STEPS = {"clean_a": 25, "clean_b": 25, "broken": 25, "long": 600, "slow": 600}
COLLECT = "trace,numerics,compile"


class Captured:
    def __init__(self, root: Path, db: Path, runs: dict[str, str]) -> None:
        self.root, self.db, self.runs = root, db, runs

    def tpudiag(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``tpudiag ARGS --db STORE`` through the CLI's ``main`` in this process (a subprocess per call would
        cost seconds of imports on a busy machine); one test below checks the same through a real process."""
        out, err = io.StringIO(), io.StringIO()
        old_cwd, old_env = os.getcwd(), dict(os.environ)
        os.chdir(self.root)
        os.environ.pop("GITHUB_STEP_SUMMARY", None)
        os.environ.update(env or {})
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main([*args, "--db", str(self.db)])
        finally:
            os.chdir(old_cwd)
            os.environ.clear()
            os.environ.update(old_env)
        return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> Captured:
    root = tmp_path_factory.mktemp("compare")
    (root / "model.py").write_text(SCRIPT)
    db = root / "store.duckdb"
    for phase in PHASES:
        procs = {}
        for name in phase:
            env = dict(
                os.environ,
                TPUDIAG_TEST_MODE=name.split("_")[0],
                TPUDIAG_TEST_NAME=name,
                TPUDIAG_TEST_PHASE=",".join(phase),
                TPUDIAG_TEST_STEPS=str(STEPS[name]),
                # Stored before each capture exits: no background store write shares the machine with the timed
                # steps of the next phase.
                TPUDIAG_WAIT="1",
            )
            env.pop("TPUDIAG_DB", None)
            procs[name] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tpudiag",
                    "capture",
                    "--db",
                    str(db),
                    "--name",
                    name,
                    "--collect",
                    COLLECT,
                    # The whole-run trace: these tests are about compare's statistics over every step's op times.
                    # (Default trace windows time every step through the pulse, ops only inside windows.)
                    "--trace",
                    "all",
                    "model.py",
                ],
                cwd=root,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=400)
            assert proc.returncode == 0, f"{name}: {err[-3000:]}"
            assert out.startswith("loss ")
    listed = json.loads(run_tpudiag("runs", "--json", "--db", str(db), cwd=root).stdout)
    return Captured(root, db, {r["name"]: r["id"] for r in listed})


def _json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode in (0, 1, 3), proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def test_injected_slow_op_is_named_slower_with_a_significant_verdict(captured: Captured) -> None:
    out = captured.tpudiag("compare", "long", "slow", "--json")
    assert out.returncode == 0, out.stderr  # compare never fails without --fail-on
    result = _json(out)
    assert set(result) >= {"comparable", "steps", "ops", "numerics", "compile"}
    assert result["comparable"]["ok"], result["comparable"]["problems"]
    entries = result["ops"]["entries"]
    slower = [e for e in entries if e["category"] == "slower"]
    tanh = next(e for e in entries if e["op"] == "aten::tanh" and e["module"] == "Net")
    assert tanh["category"] == "slower" and tanh["q_value"] < 0.01
    # 3 ms of sleep per call against tens of µs: the ratio is large and it is the biggest change of the step.
    assert tanh["ratio"] > 10 and tanh["per_step_s_b"] - tanh["per_step_s_a"] > 0.0025
    assert slower[0] is tanh and entries[0] is tanh
    assert {"op", "module", "per_step_s_a", "per_step_s_b", "category"} <= set(tanh)
    # The new kernel's own ops are there as "added", in the module that ran them.
    added = {(e["op"], e["module"]) for e in entries if e["category"] == "added"}
    assert ("aten::sinh", "Net") in added and ("aten::cosh", "Net") in added
    # No assertion on ``uniform_shift``: two runs, even side by side, can see the machine move every op by ×0.8–1.7
    # (measured here and on CI); when it is flagged, ops are judged on their share of the step, as above.

    text = captured.tpudiag("compare", "long", "slow")
    assert text.returncode == 0
    line = next(ln for ln in text.stdout.splitlines() if ln.strip().startswith("aten::tanh"))
    assert "slower" in line.split()

    failing = captured.tpudiag("compare", "long", "slow", "--fail-on", "ops")
    assert failing.returncode == 1
    assert "regression: aten::tanh in Net" in failing.stderr
    assert captured.tpudiag("compare", "long", "slow", "--fail-on", "numerics").returncode == 0


def test_two_clean_captures_pass_the_gate(captured: Captured) -> None:
    rules = captured.root / "without-steps.toml"
    rules.write_text('[tool.tpudiag.check]\n[[tool.tpudiag.check.rules]]\nmetric = "steps.steady"\nenabled = false\n')
    out = captured.tpudiag("check", "clean_b", "--baseline", "clean_a", "--rules", str(rules))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "passed" in out.stdout.splitlines()[-1]
    data = _json(captured.tpudiag("check", "clean_b", "--baseline", "clean_a", "--json"))
    status = {o["metric"]: o for o in data["outcomes"]}
    assert status["numerics.new_divergent_ops"]["status"] == "pass"
    assert status["compile.recompiles_after_warmup"]["status"] == "pass"
    assert status["compile.new_graph_breaks"]["status"] == "pass"
    # 22 steady steps of about a millisecond: whatever the machine did meanwhile, that is one block of steps per
    # run, never a step-time verdict (the CI failure this guards called such a pair ×1.6 slower at p = 3e-6).  The
    # rule passes when B measured within the allowance and is inconclusive when not: it never fails.
    steady = status["steps.steady"]
    blocks = data["comparison"]["steps"]["steady"]
    assert blocks["n_a"] >= 20 and blocks["blocks_a"] <= 2 and blocks["blocks_b"] <= 2
    assert blocks["verdict"] == "too few samples"
    if blocks["ratio"] > 1.10:
        assert steady["status"] == "inconclusive" and "too few samples" in steady["details"][0], steady
        assert data["exit_code"] == 3 and data["verdict"] == "inconclusive"
    else:
        assert steady["status"] == "pass" and data["exit_code"] == 0, steady
    # Nothing clean is called a change.
    assert not [e for e in data["comparison"]["ops"]["entries"] if e["category"] in ("slower", "faster")]


def test_fault_in_one_op_fails_the_gate_naming_op_module_and_line(captured: Captured) -> None:
    # Only the numerics rule, so the exit status can come from nothing else.
    rules = captured.root / "numerics-only.toml"
    rules.write_text(
        "[tool.tpudiag.check]\n"
        + "".join(
            f'[[tool.tpudiag.check.rules]]\nmetric = "{m}"\nenabled = false\n'
            for m in ("compile.recompiles_after_warmup", "compile.new_graph_breaks", "steps.steady")
        )
    )
    out = captured.tpudiag("check", "broken", "--baseline", "clean_a", "--rules", str(rules))
    assert out.returncode == 1, out.stdout + out.stderr
    (fail,) = [ln for ln in out.stdout.splitlines() if ln.startswith("FAIL")]
    assert "numerics.new_divergent_ops" in fail and "allowed at most 0" in fail and "seen 1" in fail
    assert f"aten::tanh in Net at model.py:{TANH_LINE}" in fail
    assert f"rules: {rules}" in out.stdout.splitlines()[-1]
    # The same rules on the clean pair pass.
    assert captured.tpudiag("check", "clean_b", "--baseline", "clean_a", "--rules", str(rules)).returncode == 0
    # Without a baseline the run is held against an ideal one: the same op fails.
    alone = captured.tpudiag("check", "broken", "--rules", str(rules))
    assert alone.returncode == 1 and f"aten::tanh in Net at model.py:{TANH_LINE}" in alone.stdout
    result = _json(captured.tpudiag("compare", "clean_a", "broken", "--json"))
    first = result["numerics"]["first_new_divergence"]
    assert (first["op"], first["module"], first["source"]) == ("aten::tanh", "Net", f"model.py:{TANH_LINE}")
    assert first["status_a"] == "pass" and first["status_b"] == "fail"
    # The reverse direction is an improvement, not a regression.
    back = _json(captured.tpudiag("compare", "broken", "clean_a", "--json"))
    assert [c["change"] for c in back["numerics"]["changes"] if c["op"] == "aten::tanh"] == ["improvement"]
    assert captured.tpudiag("check", "clean_a", "--baseline", "broken", "--rules", str(rules)).returncode == 0


def test_recompile_after_warmup_and_new_graph_break_fail_the_gate(captured: Captured) -> None:
    out = captured.tpudiag("check", "broken", "--baseline", "clean_a", "--json")
    data = _json(out)
    assert out.returncode == 1
    by_metric = {o["metric"]: o for o in data["outcomes"]}
    rec = by_metric["compile.recompiles_after_warmup"]
    assert rec["status"] == "fail" and rec["seen"].endswith("(baseline 0)")
    assert "size mismatch" in rec["where"] and rec["where"].startswith("post at ")
    gb = by_metric["compile.new_graph_breaks"]
    assert gb["status"] == "fail" and gb["file"] == "model.py" and gb["line"] == BREAK_LINE
    comp = data["comparison"]["compile"]
    assert comp["recompiles"]["a"] == 0 and comp["recompiles"]["b"] >= 1
    assert any("size mismatch" in r for r in comp["new_recompile_reasons"])


def test_baseline_file_round_trips(captured: Captured) -> None:
    base = captured.root / "baselines" / "clean.json"
    wrote = captured.tpudiag("check", "clean_a", "--baseline", str(base), "--update-baseline")
    assert wrote.returncode == 0, wrote.stderr
    assert f"wrote baseline {base}" in wrote.stderr
    data = json.loads(base.read_text())
    assert data["format"] == "tpudiag-snapshot" and data["run"]["id"] == captured.runs["clean_a"]
    assert base.stat().st_size < 200_000
    from_store = _json(captured.tpudiag("compare", "clean_a", "broken", "--json"))
    from_file = _json(captured.tpudiag("compare", str(base), "broken", "--json"))
    assert from_file == from_store
    assert captured.tpudiag("check", "broken", "--baseline", str(base)).returncode == 1
    # Writing it again from the file gives the same file.
    again = captured.root / "again.json"
    assert captured.tpudiag("check", str(base), "--update-baseline", str(again)).returncode == 0
    assert json.loads(again.read_text()) == data


def test_ci_outputs(captured: Captured, tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    gh = captured.tpudiag(
        "check", "broken", "--baseline", "clean_a", "--format", "github", env={"GITHUB_STEP_SUMMARY": str(summary)}
    )
    assert gh.returncode == 1
    error = next(ln for ln in gh.stdout.splitlines() if ln.startswith("::error "))
    assert f"file=model.py,line={TANH_LINE}," in error and "aten%3A%3Atanh" not in error.split("::", 2)[2]
    md = summary.read_text()
    assert "## tpudiag check" in md and "| fail | numerics.new_divergent_ops |" in md and "### Numerics" in md
    junit = captured.tpudiag("check", "broken", "--baseline", "clean_a", "--format", "junit")
    suite = ET.fromstring(junit.stdout)
    assert suite.tag == "testsuite" and int(suite.get("failures", "0")) >= 1
    failed = [c.get("name", "") for c in suite if c.find("failure") is not None]
    assert any(n.startswith("numerics.new_divergent_ops [aten::tanh in Net") for n in failed)
    md_compare = captured.tpudiag("compare", "long", "slow", "--format", "md")
    assert "| aten::tanh | Net | slower |" in md_compare.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["compare", "clean_a", "nope"], "no run 'nope'"),
        (["check", "nope"], "no run 'nope'"),
        (["check", "clean_a", "--baseline", "missing.json"], "cannot read missing.json"),
        (["check", "clean_a", "--rules", "nothere.toml"], "--rules nothere.toml: no such file"),
        (["compare", "clean_a", "clean_b", "--alpha", "2"], "--alpha must be between 0 and 1"),
        (["check", "clean_a", "--update-baseline"], "--update-baseline needs a file"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(captured: Captured, args: list[str], message: str) -> None:
    out = captured.tpudiag(*args)
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and message in out.stderr and "Traceback" not in out.stderr


def test_exit_statuses_through_a_real_process(captured: Captured) -> None:
    proc = run_tpudiag("check", "broken", "--baseline", "clean_a", "--db", str(captured.db), cwd=captured.root)
    assert proc.returncode == 1 and "FAIL" in proc.stdout
    proc = run_tpudiag("compare", "clean_a", "--db", str(captured.db), cwd=captured.root)
    assert proc.returncode == 2 and proc.stderr.startswith("usage:") and "Traceback" not in proc.stderr


def test_not_comparable_runs_are_refused_unless_allowed(captured: Captured, tmp_path: Path) -> None:
    other = tmp_path / "other.py"
    other.write_text("print('nothing to see')\n")
    proc = run_tpudiag(
        "capture", "--db", str(captured.db), "--name", "other", "--collect", "none", str(other), cwd=captured.root
    )
    assert proc.returncode == 0, proc.stderr
    refused = captured.tpudiag("check", "other", "--baseline", "clean_a")
    assert refused.returncode == 2 and "runs not comparable: script differs" in refused.stderr
    allowed = captured.tpudiag("check", "other", "--baseline", "clean_a", "--allow-mismatch")
    assert allowed.returncode == 0, allowed.stdout
    result = _json(captured.tpudiag("compare", "clean_a", "other", "--json"))
    assert not result["comparable"]["ok"]
    assert any(d["field"] == "script" for d in result["comparable"]["differences"])
