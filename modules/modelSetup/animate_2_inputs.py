"""A Wan2.2-Animate-2 model's training forward (DESIGN.md section 11), as diffusers' modular pipeline runs one
segment (modular_pipelines/wan_animate_2/denoise.py: `WanAnimate2RefExtractStep`, `WanAnimate2SegmentDenoiseInner`):

1. the extract pass over the clean driving-video latents (condition: an all-ones I2V mask and the same latents; the
   reference prompt; CLIP of the driving video's first frame; timestep fixed by the model) fills each layer's KV
   cache. It runs with gradients: what the adapters change in it reaches the loss through the cached K/V;
2. the cached pass over the noisy [reference slot + target] latents (condition: the batch's `condition`, the
   reference image's latent then the segment's: a first segment's, or with `animate.continuation_frames` a later
   one's, continued from the clip's own first frames) attends to that cache and gives the prediction over all
   T + 1 latent frames; the reference slot and the continuation frames carry no loss (their `loss_mask` is 0).

The self-attention runs through modules/model/animate_2_attention.py (diffusers' flex path has no backward on the
CPU and needs compiling on a GPU).
"""
import torch
from torch import Tensor

from modules.model.animate_2_condition import cached_pass, extract_pass, segment_geometry


def animate_2_prediction(transformer, batch: dict, noisy: Tensor, timestep: Tensor, text: Tensor, device,
                         spatial_stride: int) -> Tensor:
    """The cached pass's prediction (B, 16, T + 1, h, w) after the extract pass over the batch's driving video,
    through the sampler's own passes (modules/model/animate_2_condition.py)."""
    dtype = noisy.dtype
    driving = batch["driving_latents"].to(device, dtype, non_blocking=True)
    frames, height, width = driving.shape[2], driving.shape[3], driving.shape[4]
    geometry = segment_geometry((frames - 1) * 4 + 1, height * spatial_stride, width * spatial_stride,
                                spatial=spatial_stride)
    driving_condition = torch.cat([torch.ones_like(driving[:, :4]), driving], dim=1)   # all frames are condition
    cache = extract_pass(transformer, driving, driving_condition, batch["reference_text_embeds"].to(device),
                         batch["driving_image_embeds"].to(device, non_blocking=True), geometry, timestep)
    # the cache is not cleared: a checkpointed block's recomputation in the backward pass reads it again
    return cached_pass(transformer, noisy, batch["condition"].to(device, dtype, non_blocking=True), text,
                       batch["image_embeds"].to(device, non_blocking=True), cache, timestep, geometry)
