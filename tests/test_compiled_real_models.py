"""A real model compiled under the compiled-region checker: a tiny GPT-2 (transformers, built in code, no download)
trained for two steps with ``aot_eager`` and with Inductor gives no divergent graph, forward or backward, and the
script's results, RNG stream and Dynamo counters stay exactly as without the checker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from torch._dynamo.utils import counters  # noqa: E402

from tests.test_compiled_numerics import _checked  # noqa: E402


def _train_gpt2(steps: int = 2, backend: str = "aot_eager") -> Any:
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    compiled = torch.compile(model, backend=backend)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 8))
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, state, {k: dict(v) for k, v in counters.items()}, torch.rand(3)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_tiny_gpt2_compiled_has_no_divergent_graph_and_is_unchanged(tmp_path: Path, backend: str) -> None:
    # aot_eager: about 35 s on 2 cores; Inductor: a few minutes cold (its C++ kernels are built once, then come
    # from its cache).  The first run also pays transformers' first-call work (Dynamo traces more frames then), so
    # it is a warm-up and the two compared runs start alike.
    _train_gpt2(steps=1, backend=backend)
    plain = _train_gpt2(backend=backend)
    checked, summary, ops, diffs = _checked(tmp_path, lambda: _train_gpt2(backend=backend))
    losses_a, state_a, counters_a, rng_a = plain
    losses_b, state_b, counters_b, rng_b = checked
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b, strict=True))
    assert state_a.keys() == state_b.keys() and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    assert counters_a == counters_b and torch.equal(rng_a, rng_b)
    # GPT-2 breaks the graph once: both graphs, every call, forward and backward, all against float64.
    assert summary["graphs"] == 2 and summary["graph_checks"] == 4 and summary["backward_checks"] == 4
    assert summary["divergent_graphs"] == 0 and summary["divergent_backward_graphs"] == 0
    assert summary["errors"] == [] and not [o for o in ops if not o.checked]
    assert diffs and {d.verdict for d in diffs} == {"pass"}
    assert not [d for d in diffs if d.role == "originator"]


@pytest.mark.slow
def test_module_and_gradient_names_of_a_compiled_hf_model_have_no_stray_index() -> None:
    """transformers wraps its models' forwards in ``*args`` decorators, so Dynamo names the root module
    ``L['args'][0]``: forward and backward rows named ``0.model.norm`` (issue 19).  Names must be the eager ones."""
    from torch._dynamo.backends.common import aot_autograd

    from tpudiag.collectors.numerics.compiled import nodes
    from tpudiag.collectors.numerics.compiled.rows import _param_name

    names: dict[str, set[str]] = {"dynamo": set(), "forward": set(), "backward": set()}
    sources: list[str] = []

    def record(tag: str) -> Any:
        def compiler(gm: Any, example_inputs: Any) -> Any:
            names[tag].update(m for n in gm.graph.nodes if (m := nodes.module_of(n)))
            return gm.forward

        return compiler

    inner = aot_autograd(fw_compiler=record("forward"), bw_compiler=record("backward"))

    def backend(gm: Any, example_inputs: Any) -> Any:
        names["dynamo"].update(m for n in gm.graph.nodes if (m := nodes.module_of(n)))
        for n in gm.graph.nodes:
            arg = n.meta.get("grapharg") if n.op == "placeholder" else None
            if arg is not None and getattr(arg, "source", None) is not None:
                sources.append(arg.source.name)
        return inner(gm, example_inputs)

    from tpudiag.collectors.modules import ModuleTracker

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 100, (2, 8))
    # The eager names: what the module tracker calls every module an eager forward runs.  With the ``kernels``
    # package, transformers >= 5.2x makes ``apply_rotary_pos_emb`` a module-level module outside the model's tree
    # (Dynamo's stack: ``G['__import_..._modeling_llama'].apply_rotary_pos_emb``): named under each layer's
    # attention that calls it, in both.
    eager: set[str] = set()
    tracker = ModuleTracker(on_enter=lambda path, *_: eager.add(path))
    tracker.install()
    try:
        model(input_ids=ids, labels=ids)
    finally:
        tracker.remove()
    assert {n for n, m in model.named_modules() if n and not isinstance(m, torch.nn.ModuleList)} <= eager
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
    assert "model.norm" in names["dynamo"] and "model.norm" in names["backward"]
    for tag, found in names.items():
        assert found and found <= eager, (tag, sorted(found - eager))
    # The model's private copy of the kernel (compiled code skips it) adds no level of its own.
    assert not [n for n in eager if n.endswith(".Func")], sorted(eager)
    # Per caller: the second layer's rotary embedding is not the first's.
    assert all("layers.0" not in n for n in names["dynamo"] if "layers.1" in n)
    params = {_param_name(s) for s in sources if "_parameters" in s}
    assert "model.norm.weight" in params and params <= {name for name, _ in model.named_parameters()}, params
