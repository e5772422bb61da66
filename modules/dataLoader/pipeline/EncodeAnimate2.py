"""One Wan2.2-Animate-2 training item, disk-cached: the driving video read at the clip's own frame indices and cropped
as the clip was, the reference image letterboxed into the clip's frame, encoded as diffusers' modular
`WanAnimate2ModularPipeline` encodes a first segment (diffusers 0.42 modular_pipelines/wan_animate_2/encoders.py and
denoise.py: `encode_vae`, `get_i2v_mask`, `clip_visual_encode`). Items (T latent frames of the clip, h x w):
- 'latents' (16, T + 1, h, w), raw as every item's: the reference image's latent (the reference slot), then the
  clip's (the target);
- 'condition' (20, T + 1, h, w): the generation pass's condition: [ones mask + reference latent], then the first
  segment's [zero mask + latents of a black video];
- 'driving_latents' (16, T, h, w): the driving video's normalised latents (the extract pass's input; its condition
  is an all-ones mask and the same latents);
- 'image_embeds': CLIP tokens of the letterboxed reference; 'driving_image_embeds': of the driving video's first frame;
- 'loss_mask' (1, T + 1, 1, 1): 0 on the reference slot.
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
from modules.util.video_frames import frames_to_tensor
from modules.util.video_io import UnreadableMediaError, probe_media, read_frames, read_image

ANIMATE_2_ENCODING_VERSION = 1   # raise when the encoding below changes: old cache entries are then not reused
REFERENCE_PROMPT = "人物动作的参考视频"   # the pipeline's `prompt_ref` default ("reference video of the motion")


def reference_pixels(image: Image.Image, height: int, width: int) -> torch.Tensor:
    """The reference letterboxed into H x W as the pipeline's image processor does: (1, 3, H, W) in [-1, 1]."""
    from diffusers.modular_pipelines.wan_animate_2.video_processor import WanAnimate2VideoProcessor
    processor = WanAnimate2VideoProcessor(vae_scale_factor=8, spatial_patch_size=(2, 2), resample="bicubic")
    return processor.preprocess(image, height=height, width=width, resize_mode="fill").float()


def encode_item(model, video: torch.Tensor, driving: torch.Tensor, reference: Image.Image,
                black_latents: dict | None = None) -> dict:
    """The item's tensors from the clip (3, F, H, W), its driving video (1, 3, F, H, W), both in [-1, 1], and the
    reference image (see the module's docstring). `black_latents`: the black video's latents by size, reused."""
    from diffusers.modular_pipelines.wan_animate_2.encoders import clip_visual_encode, encode_vae, get_i2v_mask
    vae, clip = model.vae, model.image_encoder
    frames, height, width = video.shape[1], video.shape[2], video.shape[3]
    device = vae.device
    image = reference_pixels(reference, height, width).to(device)
    reference_latents = encode_vae(vae, image.unsqueeze(2))[0]                  # (16, 1, h, w)
    h, w = reference_latents.shape[-2:]
    reference_half = torch.cat([get_i2v_mask(1, h, w, 1, device=device).to(reference_latents.dtype),
                                reference_latents])
    # the first segment: no previous frames, so a black video under a zero mask
    black_latents = {} if black_latents is None else black_latents
    size = (frames, height, width)
    if size not in black_latents:
        black_latents[size] = encode_vae(vae, torch.zeros(1, 3, *size, device=device))[0]
    black = black_latents[size]
    segment_half = torch.cat([get_i2v_mask(black.shape[1], h, w, 0, device=device).to(black.dtype), black])
    target = encode_vae(vae, video[None].to(device))[0]
    latents = model.denormalize_latents(torch.cat([reference_latents, target], dim=1)[None])[0]
    loss_mask = torch.ones(1, latents.shape[1], 1, 1)
    loss_mask[:, 0] = 0
    dtype = clip.dtype
    return {"latents": latents.float().cpu(),
            "condition": torch.cat([reference_half, segment_half], dim=1).float().cpu(),
            "driving_latents": encode_vae(vae, driving.to(device))[0].float().cpu(),
            "image_embeds": clip_visual_encode(clip, image[0], clip.device, dtype)[0].float().cpu(),
            "driving_image_embeds": clip_visual_encode(clip, driving[0, :, 0].to(clip.device), clip.device,
                                                       dtype)[0].float().cpu(),
            "loss_mask": loss_mask}


class EncodeAnimate2(PipelineModule):
    def __init__(self, model, cache: DiskCache, identity: str, name: str | None = None):
        super().__init__(name)
        self.model, self.cache, self.identity = model, cache, identity
        self.lock = threading.Lock()
        self.encode_calls = 0
        self.black_latents: dict = {}

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
                        list(ctx.get("resolution_bucket", index)), crop, self.identity, ANIMATE_2_ENCODING_VERSION)
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
                cached = encode_item(self.model, video, driving, reference, self.black_latents)
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
