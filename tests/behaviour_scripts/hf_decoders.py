"""transformers decoders: GPT-2 and a Llama-style decoder (RMSNorm, rotary, grouped-query attention), a training
step each, then model.generate()."""

import _results
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

transformers.logging.set_verbosity_error()
torch.manual_seed(0)


def train_and_generate(model, label):
    ids = torch.randint(0, 100, (2, 12))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    print(label, "loss", repr(out.loss.item()))
    _results.add(label + " params", _results.params(model))
    model.eval()
    with torch.no_grad():
        gen = model.generate(ids[:, :4], max_new_tokens=4, do_sample=False, pad_token_id=0)
    print(label, "generated", gen.tolist())
    _results.add(label + " generate", gen)


gpt2 = GPT2LMHeadModel(
    GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=32,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
)
train_and_generate(gpt2, "gpt2")
llama = LlamaForCausalLM(
    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
)
train_and_generate(llama, "llama")
_results.finish()
