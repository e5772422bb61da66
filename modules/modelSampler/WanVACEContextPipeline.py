"""WanVACEContextPipeline: diffusers' `WanVACEPipeline` run on a control context built beforehand by the shared VACE
code (modules/model/vace_condition.py, the official wan/vace.py preparation, references in the official order).

The denoising loop is diffusers' own, unchanged. The three methods that derive the context from PIL inputs
(`preprocess_conditions`, `prepare_video_latents`, `prepare_masks`) return the given context's parts instead:
channels 0-31 (inactive / reactive latents) and 32-95 (the folded mask). `reference_count` placeholders keep the
parent's count of reference frames (it adds 4 pixel frames per reference to the noise it draws).
"""
from __future__ import annotations

import torch
from diffusers import WanVACEPipeline
from torch import Tensor


class WanVACEContextPipeline(WanVACEPipeline):

    @classmethod
    def from_model(cls, model, context: Tensor, reference_count: int) -> WanVACEContextPipeline:
        """From a WanModel's live parts (no copy of the weights); `context` (96, n + T, h, w)."""
        pipeline = cls(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                       scheduler=model.noise_scheduler, transformer=model.transformer,
                       transformer_2=model.transformer_2, boundary_ratio=model.boundary_ratio)
        pipeline.context = context
        pipeline.reference_count = reference_count
        return pipeline

    def preprocess_conditions(self, video=None, mask=None, reference_images=None, batch_size=1, height=480,
                              width=832, num_frames=81, dtype=None, device=None):
        placeholder = torch.zeros(batch_size, 1, 1, 1, 1)
        return placeholder, placeholder, [[None] * self.reference_count for _ in range(batch_size)]

    def prepare_video_latents(self, video, mask, reference_images=None, generator=None, device=None) -> Tensor:
        return self.context[None, :32].to(device or self._execution_device)

    def prepare_masks(self, mask, reference_images=None, generator=None) -> Tensor:
        return self.context[None, 32:].to(self.context.device)
