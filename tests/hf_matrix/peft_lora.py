"""A PEFT LoRA fine-tune of a small GPT-2: only the adapters train."""

import _common
import torch
import transformers
from peft import LoraConfig, get_peft_model

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
base = _common.tiny_gpt2()
model = get_peft_model(
    base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0, fan_in_fan_out=True)
)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
for _step in range(3):
    ids = torch.randint(0, 100, (2, 12))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
print("trainable", sum(p.numel() for p in model.parameters() if p.requires_grad), "loss", repr(loss.item()))
_common.add("params", _common.params(model))
_common.finish()
