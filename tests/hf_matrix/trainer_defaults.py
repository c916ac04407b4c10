"""transformers Trainer with its defaults: fused AdamW over two groups (decay / no decay), gradient clipping, the
linear lr schedule, gradient accumulation."""

import _common
import torch
import transformers
from transformers import Trainer, TrainingArguments

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = _common.tiny_gpt2()

args = TrainingArguments(
    output_dir="out",
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    max_steps=3,
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
    data_seed=0,
)
assert str(args.optim.value) == "adamw_torch_fused", args.optim
trainer = Trainer(model=model, args=args, train_dataset=_common.TokenData(16))
trainer.remove_callback(transformers.PrinterCallback)  # it prints timings, which differ run to run
result = trainer.train()
groups = trainer.optimizer.param_groups
print("groups", len(groups), [g["weight_decay"] for g in groups], "fused", groups[0].get("fused"))
print("loss", repr(result.training_loss))
_common.add("params", _common.params(model))
_common.finish()
