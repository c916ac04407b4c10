"""An Inductor-compiled decoder (Llama-style, SDPA attention): forward and backward for two steps."""

import _common
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = LlamaForCausalLM(
    LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
compiled = torch.compile(model)
for _step in range(2):
    ids = torch.randint(0, 100, (2, 16))
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("loss", repr(loss.item()))
_common.add("params", _common.params(model))
print("dynamo", _common._results.dynamo_counters())
_common.finish()
