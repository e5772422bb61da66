"""A Wan2.2-Animate-2 model's training forward (DESIGN.md section 11), as diffusers' modular pipeline runs one
segment (modular_pipelines/wan_animate_2/denoise.py: `WanAnimate2RefExtractStep`, `WanAnimate2SegmentDenoiseInner`):

1. the extract pass over the clean driving-video latents (condition: an all-ones I2V mask and the same latents; the
   reference prompt; CLIP of the driving video's first frame; timestep fixed by the model) fills each layer's KV
   cache. It runs with gradients: what the adapters change in it reaches the loss through the cached K/V;
2. the cached pass over the noisy [reference slot + target] latents (condition: the batch's `condition`, the
   reference image's latent then the first segment's) attends to that cache and gives the prediction over all
   T + 1 latent frames; the reference slot carries no loss (its `loss_mask` is 0).

The self-attention runs through modules/model/animate_2_attention.py (diffusers' flex path has no backward on the
CPU and needs compiling on a GPU).
"""
import math

import torch
from torch import Tensor


def grid(latents: Tensor, patch: tuple) -> list[int]:
    """(B, C, T, h, w) -> each sample's token grid (frames, height, width) after the patch embedding."""
    _, _, frames, height, width = latents.shape
    return [frames // patch[0], height // patch[1], width // patch[2]]


def _grid_tensor(size: list[int], batch: int) -> Tensor:
    return torch.tensor([size] * batch, dtype=torch.long)


def animate_2_prediction(transformer, batch: dict, noisy: Tensor, timestep: Tensor, text: Tensor, device,
                         spatial_stride: int) -> Tensor:
    """The cached pass's prediction (B, 16, T + 1, h, w) after the extract pass over the batch's driving video."""
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
    dtype = noisy.dtype
    driving = batch["driving_latents"].to(device, dtype, non_blocking=True)
    condition = batch["condition"].to(device, dtype, non_blocking=True)
    patch = tuple(transformer.config.patch_size)
    driving_grid, generation_grid = grid(driving, patch), grid(noisy, patch)
    driving_grid_sizes = _grid_tensor(driving_grid, driving.shape[0])
    cache = WanAnimate2KVCache(transformer.config.num_layers)
    driving_condition = torch.cat([torch.ones_like(driving[:, :4]), driving], dim=1)   # all frames are condition
    transformer(hidden_states=list(driving), timestep=timestep, condition_latents=list(driving_condition),
                encoder_hidden_states=list(batch["reference_text_embeds"].to(device, non_blocking=True)),
                encoder_hidden_states_image=batch["driving_image_embeds"].to(device, non_blocking=True),
                kv_cache=cache, kv_cache_mode="extract", seq_len=math.prod(driving_grid),
                offset_grid_sizes=driving_grid_sizes)
    frames = driving.shape[2]
    # the segment's geometry in pixels, from which the model derives its in-context layout
    origin = dict(origin_len=(frames - 1) * 4 + 1,
                  origin_area=[noisy.shape[3] * spatial_stride, noisy.shape[4] * spatial_stride])
    # the model would build (and compile) its flex block mask for this geometry; the training attention
    # (animate_2_attention.py) makes its own, so an entry stands in for it
    transformer.block_masks.setdefault((frames, driving_grid[1] * driving_grid[2]), None)
    output = transformer(hidden_states=list(noisy), timestep=timestep, condition_latents=list(condition),
                         encoder_hidden_states=list(text),
                         encoder_hidden_states_image=batch["image_embeds"].to(device, non_blocking=True),
                         kv_cache=cache, kv_cache_mode="cached", seq_len=math.prod(generation_grid),
                         reference_grid_sizes=driving_grid_sizes, **origin).sample
    # the cache is not cleared: a checkpointed block's recomputation in the backward pass reads it again
    return torch.stack(output)
