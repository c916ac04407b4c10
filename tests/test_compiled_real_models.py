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
