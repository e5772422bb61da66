"""Wan-Fun Control's condition, built as VideoX-Fun builds it; shared by the data loader and the sampler.

Reference: aigc-apps/VideoX-Fun (commit 804a425) `videox_fun/pipeline/pipeline_wan_fun_control.py` (Wan2.1-Fun
Control) and `pipeline_wan2_2_fun_control.py` (Wan2.2-Fun Control A14B), `pipeline_wan_fun_inpaint.py` (the inpaint
latents both InP and the A14B control model take). The transformer's input is cat(noisy latents, condition) on the
channels (VideoX-Fun's `y`, joined to `x` before the patch embedding):

- Wan2.1-Fun Control (48 = 16 + 32): condition = cat(control latents 16, start-image latents 16), the start image's
  latent in latent frame 0 and zeros elsewhere (zeros everywhere without a start image; zero control latents without
  a control video);
- Wan2.2-Fun Control A14B (52 = 16 + 36): condition = cat(control latents 16, mask 4, masked-video latents 16);
- the inpaint part (mask 4, masked video 16): the mask binarised at 0.5 (1 = generate), the video with the generated
  region set to 0 (grey) encoded, the mask's first frame repeated four times and the frames folded by four onto 4
  channels, inverted (1 = kept) and resized to the latent size trilinearly (frame 0 apart from the rest,
  VideoX-Fun's `resize_mask`). A mask that generates everything gives zeros for both (VideoX-Fun's
  `(mask_video == 255).all()` branch), not the latents of a grey video.

Latents are the VAE posterior mean, normalised per channel (VideoX-Fun's `AutoencoderKLWan` normalises in `encode`;
its pipelines take `.mode()`). VideoX-Fun's training draws `.sample()` and zeroes the control (and the start image)
for 10% of the items; the cache here keeps the mean, deterministic, as for every other condition.
"""
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

INPAINT_CHANNELS = 20   # 4 folded mask channels + 16 latent channels


def fun_control_condition(encode: Callable[[Tensor], Tensor], control: Tensor | None, start_image: Tensor | None,
                          num_frames: int, height: int, width: int) -> Tensor:
    """Wan2.1-Fun Control: (32, T, h, w). `control` (3, F, H, W) in [-1, 1] or None; `start_image` (3, H, W) in
    [-1, 1] or None; `encode` maps (1, 3, F, H, W) to normalised latents (1, 16, T, h, w)."""
    control_latents = _control_latents(encode, control, num_frames, height, width)
    start = torch.zeros_like(control_latents)
    if start_image is not None and start.shape[1] != 1:   # VideoX-Fun: `if latents.size()[2] != 1`
        start[:, :1] = encode(start_image.to(control_latents.dtype)[None, :, None])[0]
    return torch.cat([control_latents, start], dim=0)


def fun_control_a14b_condition(encode: Callable[[Tensor], Tensor], control: Tensor | None, video: Tensor | None,
                               mask: Tensor | None, num_frames: int, height: int, width: int) -> Tensor:
    """Wan2.2-Fun Control A14B: (36, T, h, w) = cat(control latents, inpaint_condition(video, mask))."""
    control_latents = _control_latents(encode, control, num_frames, height, width)
    if video is None:
        video = torch.zeros(3, num_frames, height, width)
    return torch.cat([control_latents, inpaint_condition(encode, video, mask)], dim=0)


def inpaint_condition(encode: Callable[[Tensor], Tensor], video: Tensor, mask: Tensor | None) -> Tensor:
    """(20, T, h, w) = cat(mask 4 (1 = kept), masked-video latents 16) of `video` (3, F, H, W) in [-1, 1] and its
    `mask` (1, F, H, W), 1 = generate (None: generate everything)."""
    frames = video.shape[1]
    latent_shape = (16, (frames - 1) // 4 + 1, video.shape[2] // 8, video.shape[3] // 8)
    if mask is None or bool((mask >= 0.5).all()):
        return video.new_zeros(INPAINT_CHANNELS, *latent_shape[1:])
    binary = (mask >= 0.5).to(video.dtype)
    masked = encode((video * (binary < 0.5))[None])[0]
    # (1, F, H, W) -> (1, 4T, H, W): frame 0 four times -> (T, 4, H, W) -> (4, T, H, W)
    folded = torch.cat([binary[:, :1].repeat_interleave(4, dim=1), binary[:, 1:]], dim=1)
    folded = folded.view(folded.shape[1] // 4, 4, *folded.shape[2:]).transpose(0, 1)
    kept = 1 - folded
    first = F.interpolate(kept[None, :, :1], size=(1, *masked.shape[2:]), mode="trilinear", align_corners=False)
    parts = [first]
    if masked.shape[1] > 1:
        parts.append(F.interpolate(kept[None, :, 1:], size=(masked.shape[1] - 1, *masked.shape[2:]),
                                   mode="trilinear", align_corners=False))
    return torch.cat([torch.cat(parts, dim=2)[0].to(masked.dtype), masked], dim=0)


def _control_latents(encode, control: Tensor | None, num_frames: int, height: int, width: int) -> Tensor:
    if control is not None:
        return encode(control[None])[0]
    return torch.zeros(16, (num_frames - 1) // 4 + 1, height // 8, width // 8)


def first_frame_inputs(video: Tensor) -> tuple[Tensor, Tensor]:
    """The A14B model's training inputs with the clip's first frame kept, as VideoX-Fun trains the start image:
    (the video with frames 1.. grey, the mask (1, F, H, W): 0 on frame 0, 1 after)."""
    mask = torch.ones_like(video[:1])
    mask[:, 0] = 0
    return video * (1 - mask), mask
