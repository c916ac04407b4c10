"""The first rule, on real models: a default capture (every collector on) behaves exactly like plain Python.

Each script in ``behaviour_scripts/`` runs twice, under ``python`` and under ``tpudiag capture`` with the default
collectors, in fresh processes with the same environment (a fresh Inductor cache each, so both compile cold).
Compared: exit status, stdout (the scripts print their results' exact values, a sha256 over the bit patterns of
every result tensor and, for compiled code, Dynamo's counters: frames, graphs, recompiles, graph breaks, unique
graphs), and stderr once tpudiag's own lines are taken out.  The capture must also have done its work (ops checked
by the numerics collector, trace events, compile events where there were compiles) and report no internal error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_tpudiag, script_env, without_tpudiag_lines

SCRIPTS = Path(__file__).parent / "behaviour_scripts"

CASES = {
    "hf_decoders": ["hf_decoders.py"],  # GPT-2, Llama-style (RMSNorm, rotary, GQA): train step, generate()
    "hf_encoders": ["hf_encoders.py"],  # BERT, T5 (encoder-decoder), ViT
    "diffusers_unets": ["diffusers_unets.py"],  # UNet2DModel, UNet2DConditionModel (cross-attention)
    "torch_features": ["torch_features.py", "--collect", "x", "--db", "y.duckdb", "--", "-m"],
    "compiled_eager_aot": ["compiled_modules.py", "eager,aot_eager"],
    "compiled_inductor": ["compiled_modules.py", "inductor", "--only-modules"],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_default_capture_behaves_as_plain_python(case: str, tmp_path: Path) -> None:
    script, *args = CASES[case]
    work = tmp_path / "work"
    work.mkdir()
    plain = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        cwd=work,
        env=script_env(tmp_path, "plain"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    db = tmp_path / "store.duckdb"
    captured = subprocess.run(
        [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), str(SCRIPTS / script), *args],
        cwd=work,
        env=script_env(tmp_path, "captured"),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert captured.returncode == plain.returncode, captured.stderr[-3000:]
    assert captured.stdout == plain.stdout
    assert "digest " in plain.stdout
    assert without_tpudiag_lines(captured.stderr) == without_tpudiag_lines(plain.stderr)
    assert "internal error" not in captured.stderr, captured.stderr[-3000:]

    report = json.loads(run_tpudiag("report", "--db", str(db), "--json", cwd=REPO).stdout)
    assert report["run"]["status"] == "ok"
    assert report["run"]["collectors"] == ["trace", "compile", "memory", "numerics"]
    assert not any("internal errors" in n for n in report["run"]["notes"])
    numerics = report["numerics"]
    assert numerics["coverage"]["ops_checked"] > 0, numerics["coverage"]
    assert "tpudiag_error" not in numerics["coverage"]["skipped"]
    assert not numerics.get("first_divergence"), numerics.get("first_divergence")
    assert report["slow_ops"], "the trace collector recorded no ops"
    if case.startswith("compiled"):
        assert report["compile"]["compiles"] > 0


def test_tpudiag_failing_inside_the_script_is_recorded_and_survived(tmp_path: Path) -> None:
    """Every piece of tpudiag code that runs in the script's context is broken on purpose (the script sabotages it
    when tpudiag is loaded): the script's exit status and output are those of plain Python, the errors are counted
    and said up front, their first tracebacks are in errors.txt, and the ops involved are skipped as tpudiag_error."""
    work = tmp_path / "work"
    work.mkdir()
    script = str(SCRIPTS / "sabotaged.py")
    plain = subprocess.run(
        [sys.executable, script],
        cwd=work,
        env=script_env(tmp_path, "plain"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    db = tmp_path / "store.duckdb"
    captured = subprocess.run(
        [sys.executable, "-m", "tpudiag", "capture", "--db", str(db), script],
        cwd=work,
        env=script_env(tmp_path, "captured"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert captured.returncode == 0, captured.stderr[-3000:]
    assert captured.stdout == plain.stdout
    assert "Traceback" not in captured.stderr
    line = next(x for x in captured.stderr.splitlines() if "internal error" in x)
    assert line.startswith("tpudiag: ") and "the script was not affected; see " in line
    errors_txt = Path(line.rsplit("see ", 1)[1])
    text = errors_txt.read_text()
    for expected in (
        "numerics: TypeError in aten::convolution",
        "numerics: ValueError in aten::add",
        "module hooks: KeyError",
        "numerics: RuntimeError in optimizer step hook",
        "compile: AttributeError in trace record",
        "sabotaged oracle",
    ):
        assert expected in text, f"{expected!r} not in errors.txt"
    assert text.count("== numerics: TypeError in aten::convolution\n") == 1  # the first traceback of each error only

    report = json.loads(run_tpudiag("report", "--db", str(db), "--json", cwd=REPO).stdout)
    assert report["run"]["status"] == "ok"
    assert report["internal_errors"] and report["internal_errors"] in line
    assert report["run"]["notes"][0].startswith("internal errors:")
    skipped = report["numerics"]["coverage"]["skipped"]
    assert skipped.get("tpudiag_error", 0) >= 2, skipped
    text_report = run_tpudiag("report", "--db", str(db), cwd=REPO).stdout
    assert any("internal error" in x for x in text_report.splitlines()[:5]), text_report[:2000]
