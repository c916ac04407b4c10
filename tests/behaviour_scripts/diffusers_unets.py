"""diffusers: UNet2DModel (convolutions with list arguments) and a small UNet2DConditionModel (cross-attention)."""

import _results
import torch
from diffusers import UNet2DConditionModel, UNet2DModel

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
x = torch.randn(1, 3, 16, 16)
out = unet(x, timestep=10).sample
out.square().mean().backward()
_results.add("unet2d", [out, [p.grad for p in unet.parameters() if p.grad is not None]])

cond = UNet2DConditionModel(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    layers_per_block=1,
    block_out_channels=(16, 32),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=16,
    attention_head_dim=4,
    norm_num_groups=8,
)
with torch.no_grad():
    out = cond(torch.randn(1, 4, 8, 8), timestep=5, encoder_hidden_states=torch.randn(1, 3, 16)).sample
_results.add("unet2d_condition", out)
print("sample mean", repr(out.mean().item()))
_results.finish()
