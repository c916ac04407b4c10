"""End to end: real transformers models captured with the numerics collector, faults injected for real.

A fault is a float32-only wrong CPU kernel registered over an aten op with ``torch.library`` (the float64 oracle
still gets the right answer), or a genuine fp16 overflow.  The report must name exactly the faulty op, its module
and source line as the first divergence and as the only originator; clean runs must report nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import transformers  # noqa: F401  (installed with dev: a broken install fails here)

from tests.conftest import run_tpudiag

PRELUDE = """
import os, sys
os.environ["HF_HUB_OFFLINE"] = "1"
import torch
import transformers
transformers.logging.set_verbosity_error()
FAULT_RATE = 3e-3


def inject(op_name, exact):
    # A float32-only wrong CPU kernel over an aten op; other dtypes (the float64 oracle) stay exact.
    lib = torch.library.Library("aten", "IMPL")

    def kernel(x, *args, **kwargs):
        value = exact(x.double(), *args, **kwargs)
        if x.dtype == torch.float32:
            return (value * (1 + FAULT_RATE)).float()
        return value.to(x.dtype)

    lib.impl(op_name, kernel, "CPU")
    return lib


def exact_tanh(x):
    return torch.where(x.abs() > 20, x.sign(), torch.sinh(x) / torch.cosh(x))


def exact_gelu(x, approximate="none"):
    return 0.5 * x * (1 + torch.special.erf(x / 2 ** 0.5))


def gpt2(**kw):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, **kw)
    return GPT2LMHeadModel(cfg)


def bert():
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, intermediate_size=64,
                     vocab_size=100, max_position_embeddings=32, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg)
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def _capture(tmp_path: Path, script: Path, *options: str) -> dict[str, Any]:
    db = tmp_path / "store.duckdb"
    proc = run_tpudiag("capture", "--db", str(db), "--collect", "numerics", *options, str(script), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rep = run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path)
    assert rep.returncode == 0, rep.stderr
    data: dict[str, Any] = json.loads(rep.stdout)
    data["_stderr"] = proc.stderr
    data["_stdout"] = proc.stdout
    data["_db"] = str(db)
    return data


def _line_of(script: Path, needle: str) -> int:
    for i, line in enumerate(script.read_text().splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(needle)


def _forward_line(cls_name: str, needle: str) -> str:
    """``activations.py:N``: the line of ``transformers.activations.<cls_name>.forward`` containing ``needle``."""
    import inspect

    import transformers.activations as acts

    lines, start = inspect.getsourcelines(getattr(acts, cls_name).forward)
    for offset, line in enumerate(lines):
        if needle in line:
            return f"{Path(acts.__file__ or '').name}:{start + offset}"
    raise AssertionError(needle)


def test_gpt2_faulty_tanh_is_the_first_divergence_and_only_originator(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        lib = inject("tanh", exact_tanh)
        torch.manual_seed(0)
        model = gpt2()
        ids = torch.randint(0, 100, (2, 16))
        out = model(ids, labels=ids)
        out.loss.backward()
    """,
    )
    data = _capture(tmp_path, script, "--numerics", "all")
    num = data["numerics"]
    first = num["first_divergence"]
    assert first is not None
    assert first["op"] == "aten::tanh"
    assert first["module"] == "transformer.h.0.mlp.act"
    assert first["phase"] == "forward"
    assert first["role"] == "originator" and first["verdict"] == "fail" and first["dtype"] == "float32"
    # The source is the line of transformers' NewGELUActivation that calls torch.tanh.
    assert first["source"].endswith(_forward_line("NewGELUActivation", "torch.tanh("))
    assert first["metrics"]["max_rel"] == pytest.approx(3e-3, rel=0.05)
    originators = [e for e in num["divergent_ops"] if e["role"] == "originator"]
    # Both layers' tanh are faulty, nothing else is.
    assert {e["op"] for e in originators} == {"aten::tanh"}
    assert [e["module"] for e in originators] == ["transformer.h.0.mlp.act", "transformer.h.1.mlp.act"]
    propagators = [e for e in num["divergent_ops"] if e["role"] == "propagator"]
    assert propagators and all(p["seq"] > first["seq"] for p in propagators)
    # The divergence reaches the backward pass, through modules tagged on the autograd graph.
    assert any(p["phase"] == "backward" and p["module"] == "transformer.h.0.mlp.act" for p in propagators)
    assert num["divergent_ops"] == sorted(num["divergent_ops"], key=lambda e: e["seq"])
    assert "first divergence: aten::tanh" in data["_stderr"]
    # The repro bundle re-runs the op (outside the faulty process it is correct, so it passes there).
    bundle = tmp_path / "bundle"
    rep = run_tpudiag("repro", "--db", data["_db"], data["run"]["id"], str(first["seq"]), "--out", str(bundle))
    assert rep.returncode == 0, rep.stderr
    ran = subprocess.run([sys.executable, str(bundle / "repro.py")], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "output 0 (float32, " in ran.stdout and ": pass" in ran.stdout


def test_bert_faulty_gelu_and_text_report_leads_with_it(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        lib = inject("gelu", exact_gelu)
        torch.manual_seed(0)
        model = bert()
        ids = torch.randint(0, 100, (2, 12))
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    """,
    )
    data = _capture(tmp_path, script)  # default sampling
    num = data["numerics"]
    first = num["first_divergence"]
    assert first["op"] == "aten::gelu"
    assert first["module"] == "bert.encoder.layer.0.intermediate.intermediate_act_fn"
    assert first["source"].endswith(_forward_line("GELUActivation", "self.act(input)"))
    assert {e["op"] for e in num["divergent_ops"] if e["role"] == "originator"} == {"aten::gelu"}
    text = run_tpudiag("report", "--db", data["_db"], cwd=tmp_path).stdout
    numerics_at = text.index("numerics")
    assert text.index("FIRST DIVERGENCE: seq") > numerics_at
    assert "aten::gelu in bert.encoder.layer.0.intermediate.intermediate_act_fn" in text
    assert text.index("FIRST DIVERGENCE") < text.index("coverage:")


def test_clean_fp32_models_report_zero_divergent_ops(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        torch.manual_seed(0)
        for model, ids in ((gpt2(), torch.randint(0, 100, (2, 16))), (bert(), torch.randint(0, 100, (2, 12)))):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            torch.optim.AdamW(model.parameters(), lr=1e-3).step()
    """,
    )
    data = _capture(tmp_path, script, "--numerics", "all")
    num = data["numerics"]
    assert num["first_divergence"] is None
    assert num["divergent_ops"] == []
    cov = num["coverage"]
    assert cov["ops_checked"] > 300
    assert cov["outputs_by_verdict"].get("pass", 0) > 300
    assert set(cov["outputs_by_verdict"]) <= {"pass", "skip"}
    # Random init is skipped for a reason, and the optimizer's in-place/foreach ops were checked.
    assert cov["skipped"]["random"] > 0
    assert set(num) == {"coverage", "first_divergence", "divergent_ops", "precision"}
    assert num["precision"]["float32_matmul_precision"] == "highest"


def test_fp16_overflow_is_its_own_verdict_at_the_overflowing_op(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        torch.manual_seed(0)
        model = gpt2()
        with torch.no_grad():
            model.transformer.h[1].mlp.c_fc.weight.mul_(300.0)  # pre-activations ~50: x**3 > 65504 in fp16
        model = model.half()
        out = model(torch.randint(0, 100, (2, 16)))
        print("finite logits:", bool(torch.isfinite(out.logits).all()))
    """,
    )
    data = _capture(tmp_path, script, "--numerics", "all")
    first = data["numerics"]["first_divergence"]
    assert first["verdict"] == "overflow" and first["role"] == "originator"
    assert first["op"] == "aten::pow" and first["dtype"] == "float16"
    assert first["module"] == "transformer.h.1.mlp.act"
    assert first["metrics"]["inf_device"] > 0 and first["metrics"]["inf_oracle"] == 0
    originators = [e for e in data["numerics"]["divergent_ops"] if e["role"] == "originator"]
    assert [e["seq"] for e in originators] == [first["seq"]]


def test_gradscaler_overflows_are_the_scaler_at_work_not_divergences(tmp_path: Path) -> None:
    """Loss scaling: a GradScaler's scaled float16 gradients overflow while its scale is too large, its check skips
    those steps and lowers the scale.  Every op checked, a clean model: no originator, no first divergence, the
    overflows kept as ``scaled_overflow`` and named in the run's notes; the script's output unchanged."""
    script = _script(
        tmp_path,
        """
        torch.manual_seed(0)
        model = gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20)  # too large: the first steps overflow
        skipped = 0
        for step in range(5):
            ids = torch.randint(0, 100, (2, 16))
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=ids, labels=ids).loss
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
            print(step, "loss", loss.item(), "scale", scaler.get_scale())
        print("skipped", skipped)
    """,
    )
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, check=True)
    assert "skipped 0" not in plain.stdout  # the scaler did skip steps: the overflows happened
    data = _capture(tmp_path, script, "--numerics", "all")
    assert data["_stdout"] == plain.stdout
    num = data["numerics"]
    assert num["first_divergence"] is None and num["divergent_ops"] == []
    notes = data["run"]["notes"]
    assert any("scaled by a GradScaler overflowed" in n for n in notes), notes
    import duckdb

    with duckdb.connect(str(tmp_path / "store.duckdb"), read_only=True) as con:
        scaled = con.execute(
            "SELECT count(*) FROM op_diffs d JOIN ops o USING (run_id, seq) "
            "WHERE d.verdict = 'scaled_overflow' AND o.phase = 'backward' AND d.dtype = 'float16'"
        ).fetchone()
    assert scaled is not None and scaled[0] > 0
    out = run_tpudiag("report", "--db", str(tmp_path / "store.duckdb"), cwd=tmp_path)
    assert "FIRST DIVERGENCE" not in out.stdout


@pytest.mark.slow
def test_torch_compile_still_compiles_under_the_collector(tmp_path: Path) -> None:
    script = tmp_path / "compiled.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        from torch._dynamo.utils import counters

        @torch.compile(backend="aot_eager")
        def f(x, w):
            return torch.tanh(x @ w).sin() * 2

        x, w = torch.randn(16, 16), torch.randn(16, 16)
        for _ in range(3):
            y = f(x, w)
        eager = torch.tanh(x @ w).sin() * 2
        print("graphs", counters["stats"]["unique_graphs"], "frames", counters["frames"]["ok"])
        print("same", bool(torch.equal(y, eager)))
        print("bits", hashlib.sha256(y.numpy().tobytes()).hexdigest())
    """)
    )
    script.write_text("import hashlib, torch\ntorch.manual_seed(0)\n" + script.read_text())
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    db = tmp_path / "store.duckdb"
    proc = run_tpudiag(
        "capture", "--db", str(db), "--collect", "numerics", "--numerics", "all", str(script), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert "graphs 1 frames 1" in proc.stdout, proc.stdout
    # Under the collector the compiled function gives bitwise what it gives without tpudiag, and what eager gives.
    assert proc.stdout == plain.stdout and "same True" in proc.stdout, (plain.stdout, proc.stdout)
    data = json.loads(run_tpudiag("report", "--db", str(db), "--json", cwd=tmp_path).stdout)
    cov = data["numerics"]["coverage"]
    assert cov["compiled_frames"] >= 1
    assert any("torch.compile" in n for n in data["run"]["notes"])
