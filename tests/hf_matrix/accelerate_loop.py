"""An accelerate.Accelerator loop: gradient accumulation, bf16 autocast on the CPU, clipping, a scheduler."""

import _common
import torch
from accelerate import Accelerator

torch.manual_seed(0)
acc = Accelerator(mixed_precision="bf16", gradient_accumulation_steps=2, cpu=True)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.5, total_iters=4)
data = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(8)]
loader = torch.utils.data.DataLoader(data, batch_size=None)
model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
for x, y in loader:
    with acc.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        acc.backward(loss)
        if acc.sync_gradients:
            acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
print("loss", repr(loss.item()), "autocast", torch.get_autocast_dtype("cpu"))
_common.add("params", _common.params(model))
_common.finish()
