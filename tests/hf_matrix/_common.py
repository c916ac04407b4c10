"""Shared by the HF matrix scripts: results digest (from ../behaviour_scripts/_results.py) and planted faults.

``HF_MATRIX_FAULT=fused_adamw`` plants a float32-faulty ``_fused_adamw_`` CPU kernel (float64 stays exact), so
the same script gives a run with real originators whose repro bundles can be replayed under the same fault.
"""

import math
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "behaviour_scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import _results
import torch

add, finish, params = _results.add, _results.finish, _results.params
FAULT = 1e-3
_LIBS = []


def _exact_fused_adamw(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    *,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    amsgrad,
    maximize,
    grad_scale=None,
    found_inf=None,
):
    for p, g, m, v, st in zip(params, grads, exp_avgs, exp_avg_sqs, state_steps, strict=False):
        step = float(st)
        p64, g64, m64, v64 = (t.double() for t in (p, g, m, v))
        p64 = p64 * (1 - lr * weight_decay)
        m64 = m64 + (g64 - m64) * (1 - beta1)
        v64 = v64 * beta2 + g64 * g64 * (1 - beta2)
        denom = (v64.sqrt() / math.sqrt(1 - beta2**step)) + eps
        p64 = p64 - (lr / (1 - beta1**step)) * m64 / denom
        if p.dtype == torch.float32:
            m64 = m64 * (1 + FAULT)
        p.copy_(p64)
        m.copy_(m64)
        v.copy_(v64)


def tiny_gpt2(n_layer=2):
    """A small GPT-2 built in code (no download), without dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=n_layer,
            n_head=2,
            n_embd=32,
            vocab_size=100,
            n_positions=32,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


class TokenData(torch.utils.data.Dataset):
    """``n`` sequences of 16 tokens, each from its own seed, as a causal LM's inputs and labels."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def plant(name):
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "fused_adamw":
            lib.impl("_fused_adamw_", _exact_fused_adamw, "CPU")
        else:
            raise ValueError(name)
    _LIBS.append(lib)


if os.environ.get("HF_MATRIX_FAULT"):
    plant(os.environ["HF_MATRIX_FAULT"])
