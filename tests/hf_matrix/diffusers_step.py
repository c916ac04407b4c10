"""A diffusers training step: noise-prediction loss on a small UNet2DModel with a DDPM scheduler."""

import _common
import torch
from diffusers import DDPMScheduler, UNet2DModel

torch.manual_seed(0)
unet = UNet2DModel(
    sample_size=16,
    in_channels=3,
    out_channels=3,
    layers_per_block=1,
    block_out_channels=(16, 32),
    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
    up_block_types=("AttnUpBlock2D", "UpBlock2D"),
    norm_num_groups=8,
)
sched = DDPMScheduler(num_train_timesteps=100)
opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
for _step in range(2):
    clean = torch.randn(2, 3, 16, 16)
    noise = torch.randn_like(clean)
    t = torch.randint(0, 100, (2,))
    noisy = sched.add_noise(clean, noise, t)
    loss = torch.nn.functional.mse_loss(unet(noisy, t).sample, noise)
    loss.backward()
    opt.step()
    opt.zero_grad()
print("loss", repr(loss.item()))
_common.add("params", _common.params(unet))
_common.finish()
