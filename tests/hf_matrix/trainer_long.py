"""transformers Trainer as long jobs run it: DataLoader workers (forked: the capture must let go in them),
gradient checkpointing (each block's forward recomputed in the backward: calls outside any module call), and more
steps than the first trace window holds."""

import _common
import torch
import transformers
from transformers import Trainer, TrainingArguments

transformers.logging.set_verbosity_error()
torch.manual_seed(0)
model = _common.tiny_gpt2(n_layer=3)

args = TrainingArguments(
    output_dir="out",
    per_device_train_batch_size=4,
    max_steps=24,
    dataloader_num_workers=2,
    gradient_checkpointing=True,
    report_to=[],
    save_strategy="no",
    logging_strategy="no",
    use_cpu=True,
    disable_tqdm=True,
    seed=0,
    data_seed=0,
)
trainer = Trainer(model=model, args=args, train_dataset=_common.TokenData(64))
trainer.remove_callback(transformers.PrinterCallback)
result = trainer.train()
print("steps", result.global_step, "loss", repr(result.training_loss))
_common.add("params", _common.params(model))
_common.finish()
