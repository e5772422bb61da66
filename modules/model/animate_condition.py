"""Wan2.2-Animate's conditions, prepared exactly as diffusers' `WanAnimatePipeline` prepares them (diffusers 0.42
pipelines/wan/pipeline_wan_animate.py; the official code is Wan-Video/Wan2.2 wan/animate.py), one set of functions
for the data loader (training items), the trainer and the sampler (DESIGN.md sections 4 and 11). Where the two
differ the official code is followed: the reference image is fitted with the official `padding_resize` (OpenCV),
not diffusers' PIL resize.

Per segment of F pixel frames (T = (F - 1) / 4 + 1 latent frames, h = H / 8, w = W / 8):
- the model input is cat(noisy latents (16, T + 1), reference latents (20, T + 1)) on channels: latent frame 0 is the
  reference character, frames 1.. the video;
- reference latents = cat on time of [I2V mask (4) + normalised VAE latent (16) of the reference image] (1 frame) and
  [I2V mask + latents of the segment condition video] (T frames): the condition video is the previous segment's
  last `prev_segment_conditioning_frames` (1 or 5) generated frames followed by zeros (animate) or by the background
  video (replace), and its mask marks those continuation frames (only after the first segment) and, in replace mode,
  1 - the character mask;
- pose latents (16, T): the pose video's normalised latents, added after the patch embedding;
- face pixels (3, F, S, S) in [-1, 1], S = the motion encoder's size (512): the face crops, read by the motion encoder;
- CLIP image tokens of the reference image (hidden_states[-2]).
Latents are the posterior mode ("argmax"), normalised (z - mean) / std per channel.
"""
from dataclasses import dataclass

import cv2
import numpy as np
import torch
import torch.nn.functional as F

from modules.model.clip_pixels import official_clip_tokens

CONDITION_CHANNELS = 4      # the I2V mask folded over the VAE's 4x temporal stride
MODES = ("animate", "replace")
CONTINUATION_FRAMES = (1, 5)   # prev_segment_conditioning_frames the official code and the pipeline use


@dataclass
class AnimateCondition:
    reference_latents: torch.Tensor   # (B, 20, T + 1, h, w): [mask, latent] of the reference, then of the segment
    pose_latents: torch.Tensor        # (B, 16, T, h, w)
    face_pixels: torch.Tensor         # (B, 3, F, S, S) in [-1, 1]
    image_embeds: torch.Tensor | None = None   # (B, tokens, CLIP width)

    def to(self, device=None, dtype=None) -> "AnimateCondition":
        move = (lambda t: None if t is None else t.to(device=device, dtype=dtype))
        return AnimateCondition(move(self.reference_latents), move(self.pose_latents), move(self.face_pixels),
                                move(self.image_embeds))


def _stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like.device, like.dtype)
    recip_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(like.device, like.dtype)
    return mean, recip_std


def encode_normalised(vae, video: torch.Tensor) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> the normalised posterior mode (B, z, T, h, w), as the pipeline's "argmax"."""
    latents = vae.encode(video.to(device=vae.device, dtype=vae.dtype)).latent_dist.mode()
    mean, recip_std = _stats(vae, latents)
    return (latents - mean) * recip_std


def denormalise(vae, latents: torch.Tensor) -> torch.Tensor:
    mean, recip_std = _stats(vae, latents)
    return latents / recip_std + mean


def i2v_mask(batch: int, latent_frames: int, height: int, width: int, mask_len: int = 1,
             mask_pixels: torch.Tensor | None = None, dtype=None, device=None, temporal: int = 4) -> torch.Tensor:
    """The I2V mask in latent layout (B, 4, T, h, w): pixel-frame mask (B, 1, 4(T-1)+1, h, w), its first `mask_len`
    frames 1, the first frame repeated 4 times, folded into 4 channels per latent frame."""
    if mask_pixels is None:
        mask = torch.zeros(batch, 1, (latent_frames - 1) * temporal + 1, height, width, dtype=dtype, device=device)
    else:
        mask = mask_pixels.clone().to(device=device, dtype=dtype)
    mask[:, :, :mask_len] = 1
    first = torch.repeat_interleave(mask[:, :, 0:1], dim=2, repeats=temporal)
    mask = torch.concat([first, mask[:, :, 1:]], dim=2)
    # (B, 1, 4T, h, w) -> (B, T, 4, h, w) -> (B, 4, T, h, w)
    return mask.view(batch, -1, temporal, height, width).transpose(1, 2)


def reference_image_latents(vae, image: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> (B, 20, 1, h, w): the I2V mask (ones) and the reference's normalised latent."""
    latents = encode_normalised(vae, image.unsqueeze(2) if image.dim() == 4 else image)
    batch, _, _, h, w = latents.shape
    mask = i2v_mask(batch, 1, h, w, 1, None, latents.dtype, latents.device, vae.config.scale_factor_temporal)
    return torch.cat([mask, latents], dim=1)


def segment_condition_latents(vae, segment_frames: int, height: int, width: int, continuation_frames: int = 1,
                              mode: str = "animate", previous: torch.Tensor | None = None,
                              background: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                              continuing: bool = False) -> torch.Tensor:
    """(B, 20, T, h, w): [mask, latents] of the segment's condition video.

    previous: (B, 3, n, H, W) the last `continuation_frames` frames of the previous segment (None on the first
    segment: zeros, or the background's first frames in replace mode); background (B, 3, F, H, W) in [-1, 1] and
    mask (B, 1, F, H, W) in [0, 1] (1 = the character) for replace mode; `continuing` marks the continuation frames
    in the mask (the pipeline does so after the first segment)."""
    if mode not in MODES:
        raise ValueError(f"animate mode {mode!r}: one of {', '.join(MODES)}")
    if mode == "replace" and (background is None or mask is None):
        raise ValueError("replace mode needs a background video and a mask video")
    dtype = vae.dtype
    reference = background if background is not None else previous
    device = reference.device if reference is not None else vae.device
    batch = reference.shape[0] if reference is not None else 1
    if previous is None:
        previous = background[:, :, :continuation_frames].to(dtype) if mode == "replace" else \
            torch.zeros(batch, 3, continuation_frames, height, width, dtype=dtype, device=device)
    if previous.shape[-2:] != (height, width):
        # spatial only, per frame, as the official code (bicubic)
        frames = previous.transpose(1, 2).flatten(0, 1)
        frames = F.interpolate(frames, size=(height, width), mode="bicubic")
        previous = frames.unflatten(0, (batch, -1)).transpose(1, 2)
    if mode == "replace":
        rest = background[:, :, continuation_frames:].to(dtype)
    else:
        rest = torch.zeros(batch, 3, segment_frames - continuation_frames, height, width, dtype=dtype, device=device)
    video = torch.cat([previous.to(dtype), rest], dim=2)
    latents = encode_normalised(vae, video)
    spatial = vae.config.scale_factor_spatial
    h, w = height // spatial, width // spatial
    mask_pixels = None
    if mode == "replace":
        # (B, 1, F, H, W) -> per frame nearest to the latent grid -> (B, 1, F, h, w); 1 where the background shows
        frames = (1 - mask).permute(0, 2, 1, 3, 4).flatten(0, 1)
        frames = F.interpolate(frames, size=(h, w), mode="nearest")
        mask_pixels = frames.unflatten(0, (batch, -1)).permute(0, 2, 1, 3, 4)
    latent_frames = (segment_frames - 1) // vae.config.scale_factor_temporal + 1
    folded = i2v_mask(batch, latent_frames, h, w, continuation_frames if continuing else 0, mask_pixels, dtype,
                      device, vae.config.scale_factor_temporal)
    return torch.cat([folded, latents], dim=1)


def pose_latents(vae, pose_video: torch.Tensor) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> (B, 16, T, h, w) normalised."""
    return encode_normalised(vae, pose_video)


def condition_latent_frames(continuation_frames: int, continuing: bool, temporal: int = 4) -> int:
    """How many leading latent frames of the generated segment are condition (never target): the reference frame,
    plus the latent frames the continuation frames occupy when the segment continues a previous one."""
    if not continuing or continuation_frames <= 0:
        return 1
    return 1 + 1 + (continuation_frames - 1 + temporal - 1) // temporal   # frame 0 alone, then 4 per latent


def transformer_condition(batch: dict, device) -> dict:
    """The Animate transformer's own inputs in a training batch (pose latents, face pixels), as keyword arguments;
    empty for every other model."""
    names = {"pose_latents": "pose_hidden_states", "face_pixels": "face_pixel_values"}
    return {argument: batch[name].to(device, non_blocking=True) for name, argument in names.items() if name in batch}


# --- pixels: the reference as the official code fits it, videos as the pipeline's processors make them ---------

def processors(spatial: int = 8):
    """The pipeline's own processors: (video, mask video)."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor(vae_scale_factor=spatial), VideoProcessor(vae_scale_factor=spatial, do_normalize=False)


def padding_resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 (h, w, 3) -> uint8 (height, width, 3): scaled with OpenCV's INTER_LINEAR to fit inside (aspect kept,
    sides truncated), centred between black bars, as the official `padding_resize` (Wan-Video/Wan2.2 wan/animate.py)
    fits the reference to the pose video's size. diffusers' WanAnimateImageProcessor places it alike but resizes
    with PIL's bilinear filter (other pixel values)."""
    ori_height, ori_width = image.shape[:2]
    padded = np.zeros((height, width, image.shape[2]), np.uint8)
    if ori_height / ori_width > height / width:   # taller than the target: bars left and right
        new_width = int(height / ori_height * ori_width)
        left = int((width - new_width) / 2)
        padded[:, left:left + new_width] = cv2.resize(image, (new_width, height), interpolation=cv2.INTER_LINEAR)
    else:   # wider (or the target's aspect): bars above and below
        new_height = int(width / ori_width * ori_height)
        top = int((height - new_height) / 2)
        padded[top:top + new_height] = cv2.resize(image, (width, new_height), interpolation=cv2.INTER_LINEAR)
    return padded


def reference_pixels(image, height: int, width: int) -> torch.Tensor:
    """A reference image (PIL or uint8 (h, w, 3) RGB) -> (1, 3, H, W) in [-1, 1]: padding_resize'd into H x W, then
    mapped as the official code maps it (x / 127.5 - 1), for training and sampling alike."""
    array = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image, dtype=np.uint8)
    fitted = padding_resize(array, height, width)
    # (H, W, 3) -> (1, 3, H, W)
    return torch.from_numpy(fitted / 127.5 - 1).permute(2, 0, 1)[None].float()


def video_pixels(frames, height: int, width: int, spatial: int = 8) -> torch.Tensor:
    """PIL frames -> (1, 3, F, H, W) in [-1, 1] (pose, background; face crops at S x S)."""
    return processors(spatial)[0].preprocess_video(frames, height=height, width=width).float()


def mask_pixels(frames, height: int, width: int, spatial: int = 8) -> torch.Tensor:
    """PIL mask frames -> (1, 1, F, H, W) in [0, 1] (1 = the character): the first (red) channel / 255, grey values
    kept, as the official prepare_source_for_replace and the data loader read it (diffusers' processor converts to
    grey levels instead: the same on grey masks)."""
    # (1, 3, F, H, W) -> (1, 1, F, H, W)
    return processors(spatial)[1].preprocess_video(frames, height=height, width=width)[:, :1].float()


def clip_image_tokens(image_encoder, reference: torch.Tensor) -> torch.Tensor:
    """CLIP tokens of the fitted reference (1, 3, H, W) in [-1, 1] (reference_pixels) as the official code makes them
    (Wan-Video/Wan2.2 wan/animate.py gives `clip.visual` the padding_resize'd reference; see clip_pixels).
    diffusers' pipeline gives CLIP the original image through its processor instead (shortest side resized, centre
    crop: other tokens for any reference not square)."""
    return official_clip_tokens(image_encoder, reference)


def pad_frames(frames: list, count: int) -> list:
    """The pipeline's reflect-like padding of conditioning videos to `count` frames: 1 2 3 4 5 4 3 2 1 2 ..."""
    index, flip, out = 0, False, []
    while len(out) < count:
        out.append(frames[index])
        index += -1 if flip else 1
        if index == 0 or index == len(frames) - 1:
            flip = not flip
    return out


def segment_plan(frames: int, segment_frames: int, continuation_frames: int) -> tuple[int, int]:
    """(padded frame count, segment count) for a long clip, as the pipeline splits it: segments of `segment_frames`
    overlapping by `continuation_frames`."""
    effective = segment_frames - continuation_frames
    last = (frames - continuation_frames) % effective
    padded = frames + (0 if last == 0 else effective - last)
    return padded, padded // effective


def build_condition(vae, reference_image: torch.Tensor, pose_video: torch.Tensor, face_video: torch.Tensor,
                    continuation_frames: int = 1, mode: str = "animate", previous: torch.Tensor | None = None,
                    background: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                    continuing: bool = False, image_embeds: torch.Tensor | None = None) -> AnimateCondition:
    """All of one segment's conditions from pixels: reference (B, 3, H, W), pose (B, 3, F, H, W), face
    (B, 3, F, S, S), all in [-1, 1]."""
    frames, height, width = pose_video.shape[2], pose_video.shape[3], pose_video.shape[4]
    reference = reference_image_latents(vae, reference_image)
    segment = segment_condition_latents(vae, frames, height, width, continuation_frames, mode, previous,
                                        background, mask, continuing)
    return AnimateCondition(torch.cat([reference.expand(segment.shape[0], -1, -1, -1, -1), segment], dim=2),
                            pose_latents(vae, pose_video), face_video, image_embeds)
