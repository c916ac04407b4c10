"""generate() compiled with a static KV cache (transformers' compile path for decoding)."""

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
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="sdpa",
    )
).eval()
ids = torch.randint(1, 100, (1, 6))
config = transformers.CompileConfig(backend="inductor")
config._compile_all_devices = True  # transformers compiles generate() on accelerators only unless told
with torch.no_grad():
    gen = model.generate(
        ids,
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
        compile_config=config,
    )
print("generated", gen.tolist())
_common.add("generate", gen)
print("dynamo", _common._results.dynamo_counters())
_common.finish()
