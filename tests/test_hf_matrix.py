"""The paths Hugging Face users take, captured with the numerics collector (issue 19): no false originator, ops really
checked, behaviour identical to plain Python; and every divergent op's repro verdict equals the in-run one.

The scripts in ``hf_matrix/`` build tiny models in code (no downloads): the ``Trainer`` with its defaults (fused
AdamW over two groups, clipping, lr schedule, gradient accumulation), the ``Trainer`` with DataLoader workers and
gradient checkpointing for more steps than the first trace window (one pulse step per optimizer step), an
``accelerate.Accelerator`` loop (gradient accumulation, bf16 autocast on the CPU), a PEFT LoRA fine-tune, a
diffusers noise-prediction step, an Inductor-compiled SDPA decoder forward and backward, and compiled ``generate()``
with a static cache. Each runs under ``python`` and under ``tpudiag capture`` in fresh processes: exit status,
stdout (exact values, a bitwise digest of the results, Dynamo's counters) and stderr without tpudiag's lines must be
equal.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, run_tpudiag, script_env, without_tpudiag_lines

SCRIPTS = Path(__file__).parent / "hf_matrix"
CASES = [
    "trainer_defaults",
    "accelerate_loop",
    "peft_lora",
    "diffusers_step",
    "compiled_decoder",
    "compiled_generate",
    "trainer_long",
]
# The ops each case must have checked against the oracle (the paths the case exists for).
MUST_CHECK = {
    "trainer_defaults": "aten::_fused_adamw_",
    "accelerate_loop": "aten::addmm",
    "peft_lora": "aten::mm",
    "diffusers_step": "aten::convolution",
    "compiled_decoder": "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "compiled_generate": "aten::mm",
    "trainer_long": "aten::_fused_adamw_",
}
# Cases whose steps are checked too: (optimizer steps, the first trace window's last step).
STEPS = {"trainer_long": (24, 19)}


def _capture(tmp: Path, case: str, **env: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    work = tmp / "work"
    work.mkdir(exist_ok=True)
    db = tmp / f"{case}.duckdb"
    proc = subprocess.run(
        [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), "--wait", str(SCRIPTS / f"{case}.py")],
        cwd=work,
        env=script_env(tmp, "captured", **env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    return proc, db


def _checked_ops(db: Path) -> dict[str, int]:
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute("select op, count(*) from ops where checked group by op").fetchall()
    return {op: n for op, n in rows}


def replay_divergent(db: Path, tmp: Path, **env: str) -> list[tuple[int, str, bool]]:
    """Every divergent op that kept its inputs, re-run through ``tpudiag repro`` (in a process with ``env``):
    (seq, op, repro says fail) for each.  The in-run verdict of an originator is a failure, so all must say so."""
    report = json.loads(run_tpudiag("report", "--db", str(db), "--json", cwd=REPO).stdout)
    out: list[tuple[int, str, bool]] = []
    for entry in report["numerics"]["divergent_ops"]:
        if entry["role"] != "originator" or not entry.get("repro"):
            continue
        bundle = tmp / f"repro-{entry['seq']}"
        made = run_tpudiag("repro", "--db", str(db), report["run"]["id"], str(entry["seq"]), "--out", str(bundle))
        assert made.returncode == 0, made.stderr
        # The bundle runs in a process with the same planted fault as the capture (the "device" it ran on).
        prelude = f"import sys; sys.path.insert(0, {str(SCRIPTS)!r}); import _common; import runpy; "
        proc = subprocess.run(
            [sys.executable, "-c", prelude + f"runpy.run_path({str(bundle / 'repro.py')!r}, run_name='__main__')"],
            env=script_env(tmp, "repro", **env),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        verdicts = re.findall(r"^output (\d+) .*: (\w+)", proc.stdout, re.M)
        index = entry["output_index"]
        said = dict(verdicts).get(str(index))
        assert said is not None, proc.stdout
        out.append((entry["seq"], entry["op"], said == "fail"))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the compiled cases build Inductor's C++ kernels cold, twice (plain and captured)
@pytest.mark.parametrize("case", CASES)
def test_hf_path_is_clean_checked_and_unchanged(case: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    plain = subprocess.run(
        [sys.executable, str(SCRIPTS / f"{case}.py")],
        cwd=work,
        env=script_env(tmp_path, "plain"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    captured, db = _capture(tmp_path, case)
    assert captured.returncode == plain.returncode, captured.stderr[-3000:]
    assert captured.stdout == plain.stdout
    assert "digest " in plain.stdout
    assert without_tpudiag_lines(captured.stderr) == without_tpudiag_lines(plain.stderr)
    assert "internal error" not in captured.stderr, captured.stderr[-3000:]

    report: dict[str, Any] = json.loads(run_tpudiag("report", "--db", str(db), "--json", cwd=REPO).stdout)
    numerics = report["numerics"]
    assert numerics["coverage"]["ops_checked"] > 0, numerics["coverage"]
    assert "tpudiag_error" not in numerics["coverage"]["skipped"]
    assert not numerics.get("first_divergence"), numerics.get("first_divergence")
    assert not [e for e in numerics["divergent_ops"] if e["role"] == "originator"]
    assert _checked_ops(db).get(MUST_CHECK[case], 0) > 0, sorted(_checked_ops(db))
    if case in STEPS:  # one pulse step per optimizer step, whatever the workers and the recomputations did
        steps, last = STEPS[case]
        assert report["pulse"]["steps"] == steps, report["pulse"]
        first = report["windows"][0]
        assert (first["reason"], first["first_step"], first["last_step"]) == ("first_steps", 0, last)
        assert all(w["last_step"] is None or w["last_step"] < steps for w in report["windows"]), report["windows"]
    # No divergence, so nothing to replay; the replay check itself is proved on the faulty run below.
    assert replay_divergent(db, tmp_path) == []


@pytest.mark.slow
def test_every_divergent_op_replays_to_the_in_run_verdict(tmp_path: Path) -> None:
    """The Trainer with a planted float32 fault in ``_fused_adamw_``: its originators are exactly that op, and each
    one's repro, run where the same fault is planted, fails too (and passes where it is not)."""
    fault = {"HF_MATRIX_FAULT": "fused_adamw"}
    captured, db = _capture(tmp_path, "trainer_defaults", **fault)
    assert captured.returncode == 0, captured.stderr[-3000:]
    report = json.loads(run_tpudiag("report", "--db", str(db), "--json", cwd=REPO).stdout)
    originators = [e for e in report["numerics"]["divergent_ops"] if e["role"] == "originator"]
    assert originators and {e["op"] for e in originators} == {"aten::_fused_adamw_"}
    replayed = replay_divergent(db, tmp_path, **fault)
    assert replayed and all(fails for _, _, fails in replayed), replayed
    assert len(replayed) == len([e for e in originators if e.get("repro")])
