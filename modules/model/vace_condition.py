"""VACE's control context, built exactly as the official code builds it; shared by the data loader and the sampler.

Reference: Wan-Video/Wan2.1 `wan/vace.py` (`WanVace.vace_encode_frames`, `vace_encode_masks`, `vace_latent`, and
`prepare_source`'s fit of reference images onto a white canvas). diffusers' `WanVACEPipeline` prepares the same
tensors (`preprocess_conditions`, `prepare_video_latents`, `prepare_masks`) with two differences: it prepends each
reference in turn, so several references end up in reverse order ([ref1, ref0, video] where the official code gives
[ref0, ref1, video]); and it splits the control by each colour channel of the mask, where the official code splits
all three by the mask's first channel (the two agree on grey masks, R = G = B). The official code is followed here; a
diffusers user gets the same tensors by passing the references to `WanVACEPipeline` reversed and a grey mask.

A mask file is read once, for training and sampling alike (`mask_from_frames`): its first (red) channel mapped to
[0, 1] as `prepare_source` maps it, never binarised; only the kept / generated split thresholds it.

The context (B, 96, n + T, h, w) for n references and T latent frames of the video:
- channels 0-15: normalised latents of the control video where the mask is 0 ("inactive": kept), zeros elsewhere;
- channels 16-31: latents of the control video where the mask is 1 ("reactive": to generate); the split uses the mask
  binarised at 0.5;
- channels 32-95: the pixel mask, grey values kept, folded 8x8 into 64 channels, resampled to T frames
  (nearest-exact);
- the first n latent frames: each reference image's latent (its reactive half and its mask zero).
"""
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

CONTEXT_CHANNELS = 96   # 16 inactive + 16 reactive latent channels + 8 x 8 folded mask


def image_to_tensor(image) -> Tensor:
    """A PIL image or (H, W, 3) uint8 array -> (3, H, W) float32 in [-1, 1], as the official code reads references
    (torchvision's to_tensor, then (x - 0.5) / 0.5)."""
    array = np.array(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.uint8)
    return torch.from_numpy(array).permute(2, 0, 1).float().div(255).sub(0.5).div(0.5)


def mask_from_frames(frames: np.ndarray) -> Tensor:
    """uint8 (F, H, W, 3) mask frames -> (1, F, H, W) float32 in [0, 1], 1 = generate: the first (red) channel, grey
    values kept, as prepare_source reads a mask video ([-1, 1] as every video, then clamp((m + 1) / 2, 0, 1))."""
    # (F, H, W, 3) -> (1, F, H, W), in [-1, 1] as video_frames.frames_to_tensor maps every video
    first = torch.from_numpy(np.ascontiguousarray(frames[..., :1])).permute(3, 0, 1, 2).float().div_(127.5).sub_(1.0)
    return torch.clamp((first + 1) / 2, min=0, max=1)


def fit_reference(image: Tensor, height: int, width: int) -> Tensor:
    """(3, h, w) in [-1, 1] -> (3, height, width): scaled to fit inside (aspect kept, bilinear), centred on a white
    canvas (prepare_source's fit); an image of the video's size is used as it is."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    ref_height, ref_width = image.shape[-2:]
    scale = min(height / ref_height, width / ref_width)
    new_height, new_width = int(ref_height * scale), int(ref_width * scale)
    resized = F.interpolate(image[None], size=(new_height, new_width), mode="bilinear", align_corners=False)[0]
    canvas = torch.ones(3, height, width, dtype=image.dtype, device=image.device)
    top, left = (height - new_height) // 2, (width - new_width) // 2
    canvas[:, top:top + new_height, left:left + new_width] = resized
    return canvas


def fold_mask(mask: Tensor, reference_count: int, spatial_stride: int = 8, temporal_stride: int = 4,
              patch: int = 2) -> Tensor:
    """(1, F, H, W) pixel mask in [0, 1] -> (64, n + T, h, w) (vace_encode_masks): each 8x8 pixel cell becomes 64
    channels, the F frames are resampled to T = (F + 3) // 4 by nearest-exact, n zero frames go first."""
    _, frames, height, width = mask.shape
    latent_frames = (frames + temporal_stride - 1) // temporal_stride
    # latent sides rounded down to the transformer patch, as the official code does
    latent_height = patch * (height // (spatial_stride * patch))
    latent_width = patch * (width // (spatial_stride * patch))
    # (F, h, 8, w, 8) -> (8, 8, F, h, w) -> (64, F, h, w)
    folded = mask[0].view(frames, latent_height, spatial_stride, latent_width, spatial_stride)
    folded = folded.permute(2, 4, 0, 1, 3).reshape(spatial_stride * spatial_stride, frames, latent_height,
                                                    latent_width)
    folded = F.interpolate(folded[None], size=(latent_frames, latent_height, latent_width),
                           mode="nearest-exact")[0]
    if reference_count:
        folded = torch.cat([folded.new_zeros(folded.shape[0], reference_count, *folded.shape[2:]), folded], dim=1)
    return folded


def encode_frames(encode: Callable[[Tensor], Tensor], video: Tensor, mask: Tensor | None,
                  references: Sequence[Tensor]) -> Tensor:
    """(3, F, H, W) control video in [-1, 1], its (1, F, H, W) mask or None, references (3, H, W) each ->
    (32, n + T, h, w) (16 channels without a mask), as vace_encode_frames. `encode` maps a (1, 3, F, H, W) video to
    its normalised latents (1, 16, T, h, w)."""
    if mask is None:
        latents = encode(video[None])[0]
    else:
        binary = torch.where(mask > 0.5, 1.0, 0.0).to(video.dtype)
        inactive = encode((video * (1 - binary))[None])[0]
        reactive = encode((video * binary)[None])[0]
        latents = torch.cat([inactive, reactive], dim=0)
    if not references:
        return latents
    reference_latents = []
    for reference in references:
        latent = encode(reference[None, :, None])[0]   # one frame: (16, 1, h, w)
        if mask is not None:
            latent = torch.cat([latent, torch.zeros_like(latent)], dim=0)
        reference_latents.append(latent)
    return torch.cat([*reference_latents, latents], dim=1)


def vace_context(encode: Callable[[Tensor], Tensor], video: Tensor | None, mask: Tensor | None,
                 references: Sequence[Tensor] = (), num_frames: int | None = None, height: int | None = None,
                 width: int | None = None) -> Tensor:
    """The control context (96, n + T, h, w) of one clip (vace_latent of the two above).

    `video` (3, F, H, W) in [-1, 1] or None (then zeros of `num_frames` x `height` x `width` and an all-ones mask,
    whatever `mask` is, as prepare_source does without a video: generate everything); `mask` (1, F, H, W) in [0, 1]
    (mask_from_frames), 1 = generate, or None (all ones); `references` (3, h', w') in [-1, 1] each, fitted
    onto the video's size here. Order as the official code: references first, in the order given."""
    if video is None:
        video, mask = torch.zeros(3, num_frames, height, width), None
    if mask is None:
        mask = torch.ones_like(video[:1])
    if mask.shape[1:] != video.shape[1:]:
        raise ValueError(f"the mask has {mask.shape[1]} frames of {mask.shape[3]}x{mask.shape[2]}, the control video "
                         f"{video.shape[1]} of {video.shape[3]}x{video.shape[2]}; they must match")
    fitted = [fit_reference(reference.to(video.dtype), video.shape[2], video.shape[3]) for reference in references]
    frames = encode_frames(encode, video, mask, fitted)
    folded = fold_mask(mask, len(fitted)).to(device=frames.device, dtype=frames.dtype)
    return torch.cat([frames, folded], dim=0)


def model_encoder(model) -> Callable[[Tensor], Tensor]:
    """`encode` for the functions above from a WanModel: the VAE posterior mean, normalised, in float32."""
    return lambda video: model.normalize_latents(model.encode_video(video).float())


def control_scale(scale: float, transformer) -> Tensor:
    """`control_hidden_states_scale`: the official `vace_context_scale`, one value for every VACE block."""
    layers = len(transformer.config.vace_layers)
    parameter = next(transformer.parameters())
    return torch.full((layers,), float(scale), device=parameter.device, dtype=parameter.dtype)
