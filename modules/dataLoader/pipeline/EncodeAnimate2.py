"""One Wan2.2-Animate-2 training item, disk-cached: the driving video read at the clip's own frame indices and cropped
as the clip was, the reference image letterboxed into the clip's frame, encoded as diffusers' modular
`WanAnimate2ModularPipeline` encodes a segment (diffusers 0.42 modular_pipelines/wan_animate_2/encoders.py and
denoise.py: `encode_vae`, `get_i2v_mask`, `clip_visual_encode`), through the sampler's own condition functions
(modules/model/animate_2_condition.py). Items (T latent frames of the clip, h x w):
- 'latents' (16, T + 1, h, w), raw as every item's: the reference image's latent (the reference slot), then the
  clip's (the target);
- 'condition' (20, T + 1, h, w): the generation pass's condition: [ones mask + reference latent], then the
  segment's [I2V mask + latents]: of a black video on a first segment; with `continuation_frames` k (1 or 5), of the
  clip's own first k frames (standing for the previous segment's last k generated frames) followed by black frames,
  as the sampler conditions a later segment;
- 'driving_latents' (16, T, h, w): the driving video's normalised latents (the extract pass's input; its condition
  is an all-ones mask and the same latents);
- 'image_embeds': CLIP tokens of the letterboxed reference; 'driving_image_embeds': of the driving video's first frame;
- 'loss_mask' (1, T + 1, 1, 1): 0 on the reference slot and on the latent frames the k continuation frames occupy.
The reference prompt of the extract pass is encoded once by EncodeReferencePrompt (the text encoder's pass)."""
import threading
from typing import Any

import numpy as np
import torch
from PIL import Image

from modules.dataLoader.DiskCache import DiskCache, cache_key, file_identity
from modules.dataLoader.pipeline.EncodeAnimate import as_clip
from modules.dataLoader.pipeline.EncodeText import EncodeText
from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.model.animate_2_condition import (REFERENCE_PROMPT, clip_tokens, encode_vae, reference_image_latents,
                                               reference_latents)
from modules.model.animate_condition import condition_latent_frames
from modules.util.video_frames import frames_to_tensor
from modules.util.video_io import UnreadableMediaError, probe_media, read_frames, read_image

ANIMATE_2_ENCODING_VERSION = 1   # raise when the encoding below changes: old cache entries are then not reused


def reference_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """The reference letterboxed into H x W as the pipeline's image processor does: (1, 3, H, W) in [-1, 1]."""
    from diffusers.modular_pipelines.wan_animate_2.video_processor import WanAnimate2VideoProcessor
    processor = WanAnimate2VideoProcessor(vae_scale_factor=8, spatial_patch_size=(2, 2), resample="bicubic")
    return processor.preprocess(image, height=height, width=width, resize_mode="fill").float()


def encode_item(model, video: torch.Tensor, driving: torch.Tensor, reference: Image.Image,
                continuation_frames: int = 0, first_segments: dict | None = None) -> dict:
    """The item's tensors from the clip (3, F, H, W), its driving video (1, 3, F, H, W), both in [-1, 1], and the
    reference image (see the module's docstring). `first_segments`: the first segment's condition half (the same
    black video for every clip of a size) by size, reused."""
    vae, clip = model.vae, model.image_encoder
    frames, height, width = video.shape[1], video.shape[2], video.shape[3]
    device = vae.device
    image = reference_pixels(reference, height, width).to(device)
    image_latents = reference_image_latents(vae, image)                         # (1, 20, 1, h, w)
    carry = continuation_frames
    if carry:
        condition = reference_latents(vae, image_latents, frames, previous=video[None, :, :carry].to(device))
    else:
        first_segments = {} if first_segments is None else first_segments
        size = (frames, height, width)
        if size not in first_segments:
            first_segments[size] = reference_latents(vae, image_latents, frames)[:, :, 1:]
        condition = torch.cat([image_latents, first_segments[size].to(image_latents.dtype)], dim=2)
    target = encode_vae(vae, video[None].to(device))[0]
    latents = model.denormalize_latents(torch.cat([image_latents[0, 4:], target], dim=1)[None])[0]
    loss_mask = torch.ones(1, latents.shape[1], 1, 1)
    loss_mask[:, :condition_latent_frames(carry, carry > 0, vae.config.scale_factor_temporal)] = 0
    return {"latents": latents.float().cpu(),
            "condition": condition[0].float().cpu(),
            "driving_latents": encode_vae(vae, driving.to(device))[0].float().cpu(),
            "image_embeds": clip_tokens(clip, image[0].to(clip.device))[0].float().cpu(),
            "driving_image_embeds": clip_tokens(clip, driving[0, :, 0].to(clip.device))[0].float().cpu(),
            "loss_mask": loss_mask}


class EncodeAnimate2(PipelineModule):
    def __init__(self, model, cache: DiskCache, identity: str, continuation_frames: int = 0,
                 name: str | None = None):
        super().__init__(name)
        self.model, self.cache, self.identity = model, cache, identity
        self.continuation_frames = continuation_frames
        self.lock = threading.Lock()
        self.encode_calls = 0
        self.first_segments: dict = {}

    def needs(self) -> list[str]:
        return ["path", "frame_indices", "resolution_bucket", "video", "crop", "companions"]

    def produces(self) -> list[str]:
        return ["latents", "condition", "driving_latents", "image_embeds", "driving_image_embeds", "loss_mask"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        companions = ctx.get("companions", index)
        crop = ctx.get("crop", index)
        indices = list(ctx.get("frame_indices", index))
        key = cache_key("animate-2", file_identity(ctx.get("path", index)),
                        {k: file_identity(v) if v else None for k, v in companions.items()}, indices,
                        list(ctx.get("resolution_bucket", index)), crop, self.identity, self.continuation_frames,
                        ANIMATE_2_ENCODING_VERSION)
        cached = self.cache.get(key, required=self.produces())
        if cached is None:
            video = ctx.get("video", index)
            try:
                path = companions["driving"]
                frames = read_frames(path, indices, probe_media(path))
                reference = Image.fromarray(read_image(companions["reference"]))
            except UnreadableMediaError as error:
                raise UnreadableMediaError(ctx.get("path", index), f"its companion {error.path}: {error.reason}") \
                    from error
            driving = frames_to_tensor(as_clip(np.asarray(frames), crop, video.shape[2], video.shape[3]))[None]
            with self.lock, torch.no_grad():
                self.encode_calls += 1
                cached = encode_item(self.model, video, driving, reference, self.continuation_frames,
                                     self.first_segments)
            self.cache.put(key, cached)
        return {name: cached[name] for name in self.produces()}


class EncodeReferencePrompt(EncodeText):
    """The extract pass's text: UMT5 embeddings of the pipeline's reference prompt, the same for every item (cached
    once, in the text encoder's pass)."""

    def needs(self) -> list[str]:
        return []

    def produces(self) -> list[str]:
        return ["reference_text_embeds"]

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        return {"reference_text_embeds": self._embeds(REFERENCE_PROMPT)}
