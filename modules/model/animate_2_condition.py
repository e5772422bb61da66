"""Wan2.2-Animate-2's per-segment conditions and its two transformer passes, prepared exactly as diffusers' modular
`WanAnimate2ModularPipeline` prepares them (diffusers 0.42 modular_pipelines/wan_animate_2: encoders.py,
before_denoise.py, denoise.py), one set of functions for the sampler and the trainer.

Per segment of F pixel frames (T = (F - 1) / 4 + 1 latent frames, h = H / 8, w = W / 8), batch B:
- extract pass: the transformer runs over the clean driving-video segment (latents (B, 16, T, h, w), condition =
  I2V mask of ones (4) + the same latents: (B, 20, T, h, w)) with the reference prompt and the CLIP tokens of the
  driving video's first frame, and fills a `WanAnimate2KVCache` with every layer's K/V;
- cached pass (each denoising step): the noisy latents (B, 16, T + 1, h, w) (latent frame 0 is the reference image's
  slot), condition = reference latents (B, 20, T + 1, h, w): [I2V mask (ones) + reference image latent] (1 frame)
  stacked on time over [I2V mask (the continuation frames) + latents of the previous segment's last frames followed
  by zero frames] (T frames; all zeros on the first segment), with the prompt and the reference image's CLIP tokens,
  attending jointly to the cached K/V (flex attention under a block mask).
Latents are the posterior mode, normalised (z - mean) / std per channel (diffusers' `encode_vae`).
No function here disables gradients: training runs both passes with gradients (LoRA in the blocks), sampling wraps
them in `torch.no_grad` itself.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
from diffusers.modular_pipelines.wan_animate_2.encoders import clip_visual_encode, encode_vae, get_i2v_mask

REFERENCE_PROMPT = "人物动作的参考视频"   # the pipeline's default `prompt_ref` ("reference video of the motion")
CONTINUATION_FRAMES = (1, 5)            # prev_segment_conditioning_frames the release uses

__all__ = ["REFERENCE_PROMPT", "CONTINUATION_FRAMES", "SegmentGeometry", "segment_geometry", "clip_tokens",
           "driving_condition", "reference_image_latents", "reference_latents", "extract_pass", "cached_pass",
           "encode_vae"]


@dataclass(frozen=True)
class SegmentGeometry:
    """What the transformer needs to know of a segment's latent grid (the pipeline's PrepareSegmentsStep)."""
    frames: int                   # F, pixel frames per segment (the pipeline's segment_frame_length)
    height: int                   # H, pixels
    width: int                    # W, pixels
    grid_sizes_ref: torch.Tensor  # (1, 3) long: the driving segment's post-patch grid [[T, h / 2, w / 2]]
    seq_len: int                  # tokens of the cached pass: (T + 1) * h / 2 * w / 2
    seq_len_ref: int              # tokens of the extract pass: T * h * w / 4


def segment_geometry(frames: int, height: int, width: int, spatial: int = 8, temporal: int = 4) -> SegmentGeometry:
    """The geometry of a segment of `frames` pixel frames of `height` x `width` (multiples of 16)."""
    latent_frames = (frames - 1) // temporal + 1
    h, w = height // spatial, width // spatial
    grid = torch.tensor([[latent_frames, h // 2, w // 2]], dtype=torch.long)
    return SegmentGeometry(frames, height, width, grid, (latent_frames + 1) * (h // 2) * (w // 2),
                           int(math.prod((latent_frames, h, w)) // 4))


def clip_tokens(image_encoder, pixels: torch.Tensor) -> torch.Tensor:
    """(3, H, W) in [-1, 1] -> (1, tokens, 1280): CLIP hidden_states[-2] of one frame resized to 224 (bicubic), as the
    pipeline encodes the reference image and the driving video's first frame."""
    return clip_visual_encode(image_encoder, pixels, pixels.device, image_encoder.dtype)


def driving_condition(vae, driving_pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 3, F, H, W) in [-1, 1], one segment of the driving video -> (latents (B, 16, T, h, w),
    condition (B, 20, T, h, w)): the latents and [I2V mask of ones, latents], the extract pass's inputs. Each segment
    is encoded on its own: the VAE is causal in time, so slicing whole-video latents would differ."""
    latents = encode_vae(vae, driving_pixels)
    batch, _, latent_frames, h, w = latents.shape
    mask = get_i2v_mask(latent_frames, h, w, driving_pixels.shape[2], device=latents.device).to(latents.dtype)
    return latents, torch.cat([mask.expand(batch, -1, -1, -1, -1), latents], dim=1)


def reference_image_latents(vae, image_pixels: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1], the letterboxed reference image -> (B, 20, 1, h, w): [I2V mask of ones, latent]."""
    latents = encode_vae(vae, image_pixels.unsqueeze(2))
    batch, _, _, h, w = latents.shape
    mask = get_i2v_mask(1, h, w, 1, device=latents.device).to(latents.dtype)
    return torch.cat([mask.expand(batch, -1, -1, -1, -1), latents], dim=1)


def reference_latents(vae, image_latents: torch.Tensor, frames: int, previous: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """The cached pass's condition (B, 20, T + 1, h, w): `image_latents` (B, 20, 1, h, w) from
    `reference_image_latents` stacked on time over [I2V mask, latents] of a `frames`-frame video that is `previous`
    (B, 3, n, H', W') in [-1, 1] -- the previous segment's last n (1 or 5) generated frames, resized bicubic to the
    segment's size -- followed by zero frames; all zeros (and a zero mask) when `previous` is None (first segment)."""
    batch, _, _, h, w = image_latents.shape
    spatial = vae.config.scale_factor_spatial
    height, width = h * spatial, w * spatial
    device = image_latents.device
    carried = 0 if previous is None else previous.shape[2]
    pixels = torch.zeros(batch, 3, frames, height, width, device=device)
    if carried:
        # (B, 3, n, H', W') -> (B * n, 3, H', W') -> bicubic -> back; the pipeline resizes per frame
        resized = F.interpolate(previous.transpose(1, 2).flatten(0, 1), size=(height, width), mode="bicubic")
        pixels = torch.cat([resized.unflatten(0, (batch, carried)).transpose(1, 2).to(pixels.dtype),
                            pixels[:, :, carried:]], dim=2)
    latents = encode_vae(vae, pixels)
    mask = get_i2v_mask(latents.shape[2], h, w, carried, device=device).to(latents.dtype)
    segment = torch.cat([mask.expand(batch, -1, -1, -1, -1), latents], dim=1)
    return torch.cat([image_latents.to(segment.dtype), segment], dim=2)


def _unbatch(tensor: torch.Tensor, dtype) -> list[torch.Tensor]:
    return list(tensor.to(dtype).unbind(0))   # the transformer takes one (C, ...) tensor per sample


def extract_pass(transformer, driving_latents: torch.Tensor, condition: torch.Tensor,
                 reference_prompt_embeds: torch.Tensor, driving_clip: torch.Tensor, geometry: SegmentGeometry,
                 timestep: torch.Tensor | None = None) -> WanAnimate2KVCache:
    """Runs the transformer's extract pass and returns the filled KV cache.

    driving_latents (B, 16, T, h, w) and condition (B, 20, T, h, w) from `driving_condition`;
    reference_prompt_embeds (B, L, 4096): the reference prompt's UMT5 states (zero past its length);
    driving_clip (B, tokens, 1280): `clip_tokens` of the driving video's first frame. The pass is modulated at a fixed
    timestep (the transformer uses t * 0 + 1), so `timestep` only sets the device and dtype (the pipeline passes its
    first sampling timestep)."""
    dtype = transformer.dtype
    batch = driving_latents.shape[0]
    if timestep is None:
        timestep = torch.ones(batch, device=driving_latents.device)
    cache = WanAnimate2KVCache(transformer.config.num_layers)
    transformer(_unbatch(driving_latents, dtype), timestep=timestep.to(dtype),
                encoder_hidden_states=_unbatch(reference_prompt_embeds, dtype),
                encoder_hidden_states_image=driving_clip.to(dtype), condition_latents=_unbatch(condition, dtype),
                kv_cache=cache, kv_cache_mode="extract", seq_len=geometry.seq_len_ref,
                offset_grid_sizes=geometry.grid_sizes_ref)
    return cache


def cached_pass(transformer, noisy_latents: torch.Tensor, reference: torch.Tensor, prompt_embeds: torch.Tensor,
                image_clip: torch.Tensor, cache: WanAnimate2KVCache, timestep: torch.Tensor,
                geometry: SegmentGeometry, unconditional: bool = False) -> torch.Tensor:
    """The transformer's prediction (B, 16, T + 1, h, w) in float32 for `noisy_latents` (B, 16, T + 1, h, w).

    reference (B, 20, T + 1, h, w) from `reference_latents`; prompt_embeds (B, L, 4096); image_clip
    (B, tokens, 1280): `clip_tokens` of the reference image; cache: filled by `extract_pass` for this segment;
    timestep (B,); `unconditional` marks the guidance's unconditional branch (the transformer skips its block 9)."""
    dtype = transformer.dtype
    output = transformer(_unbatch(noisy_latents, dtype), timestep=timestep,
                         encoder_hidden_states=_unbatch(prompt_embeds, dtype),
                         encoder_hidden_states_image=image_clip.to(dtype), condition_latents=_unbatch(reference, dtype),
                         kv_cache=cache, kv_cache_mode="cached", seq_len=geometry.seq_len,
                         # one grid row per sample: the cached keys' RoPE is applied sample by sample
                         reference_grid_sizes=geometry.grid_sizes_ref.expand(noisy_latents.shape[0], -1),
                         origin_len=geometry.frames,
                         origin_area=[geometry.height, geometry.width], is_uncondtion=unconditional).sample
    return torch.stack(output)
