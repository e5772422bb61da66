import threading
from typing import Any

import torch

from modules.dataLoader.DiskCache import DiskCache, cache_key, file_identity
from modules.dataLoader.pipeline.PipelineModule import PipelineModule
from modules.model.clip_pixels import CLIP_PREPROCESS
from modules.util.video_frames import tensor_to_frames


class EncodeVideo(PipelineModule):
    """VAE latents of the clip (raw posterior mean; normalisation happens at training time), cached on disk by the
    source file's identity and every setting that changes them. For image-conditioned variants it also encodes the
    condition (folded mask + normalised latents of the first, or first and last, frame) and the CLIP tokens of those
    frames, with the same WanModel functions the sampler uses."""

    def __init__(self, model, cache: DiskCache, identity: str, condition: str | None = None,
                 clip: bool = False, augmented: bool = False, latent_dtype: torch.dtype = torch.float32,
                 name: str | None = None):
        """`latent_dtype`: how the latents are stored (bfloat16 halves the cache and the host-to-device copy of
        every batch; training upcasts them)."""
        super().__init__(name)
        if condition not in (None, "first", "first_last"):
            raise ValueError(f"condition must be None, 'first' or 'first_last', not {condition!r}")
        self.model, self.cache, self.identity = model, cache, identity
        self.condition, self.clip, self.augmented = condition, clip, augmented
        self.latent_dtype = latent_dtype
        self.lock = threading.Lock()
        self.encode_calls = 0

    def needs(self) -> list[str]:
        return ["path", "frame_indices", "resolution_bucket", "video", "crop"]

    def produces(self) -> list[str]:
        return ["latents"] + (["condition"] if self.condition else []) + (["image_embeds"] if self.clip else [])

    def key(self, ctx, index: int) -> str:
        parts = ["video", file_identity(ctx.get("path", index)), list(ctx.get("frame_indices", index)),
                 list(ctx.get("resolution_bucket", index)), self.identity, self.condition, self.clip]
        if self.latent_dtype != torch.float32:
            parts.append(str(self.latent_dtype))
        if self.clip:
            parts.append(CLIP_PREPROCESS)
        if self.augmented:
            parts.append(ctx.get("crop", index))  # random crops and flips are cached per variation
        return cache_key(*parts)

    def get_item(self, ctx, index: int) -> dict[str, Any]:
        key = self.key(ctx, index)
        cached = self.cache.get(key, required=self.produces())
        if cached is None:
            cached = self._encode(ctx.get("video", index))
            self.cache.put(key, cached)
        return {name: cached[name] for name in self.produces()}

    def _encode(self, video: torch.Tensor) -> dict[str, torch.Tensor]:
        model = self.model
        with self.lock, torch.no_grad():
            self.encode_calls += 1
            result = {"latents": model.encode_video(video[None])[0].to(self.latent_dtype).cpu()}
            if self.condition:
                last = video[:, -1][None] if self.condition == "first_last" else None
                condition_video, mask = model.first_last_condition_video(video[:, 0][None], last, video.shape[1])
                result["condition"] = model.make_condition(condition_video, mask)[0].float().cpu()
            if self.clip:
                frames = tensor_to_frames(video)
                images = [frames[0]] + ([frames[-1]] if self.condition == "first_last" else [])
                # (N, tokens, dim) -> (N*tokens, dim): the elements' tokens one after another
                result["image_embeds"] = model.encode_image(images).flatten(0, 1).float().cpu()
        return result
