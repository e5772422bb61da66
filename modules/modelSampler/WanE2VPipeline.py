"""WanE2VPipeline: diffusers' `WanImageToVideoPipeline` with an Elements-to-Video condition (DESIGN.md 6.11).

The denoising loop is diffusers' own, unchanged. Only the two places where the I2V pipeline derives its condition
from one image are replaced by tensors computed beforehand with the shared E2V code (modules/model/e2v_condition.py,
the functions the data loader uses):

- `prepare_latents` returns (noise latents drawn exactly as the parent draws them, the given E2V condition
  (B, C, T, h, w) repeated to the batch) instead of VAE-encoding a first frame;
- `encode_image` returns the given multi-element CLIP tokens (N * tokens, dim in position order) instead of
  encoding the image. A transformer with an image branch given no tokens (`e2v_type` vae) gets zero image tokens,
  which is what its forward computes with `encoder_hidden_states_image=None` in training.

`image` is a placeholder (a grey PIL image) that only satisfies the parent's input checks and preprocessing; it
reaches neither the VAE nor CLIP. Text must be exactly 512 tokens for a transformer with an image branch (diffusers
splits image from text tokens as "all but the last 512", DESIGN.md 6.9): the pipeline pads prompts to 512 itself
(max_sequence_length=512), and given `prompt_embeds` must already have 512 tokens.
"""
from __future__ import annotations

import torch
from diffusers import WanImageToVideoPipeline
from diffusers.utils.torch_utils import randn_tensor
from PIL import Image
from torch import Tensor

from modules.model.WanModel import TEXT_SEQUENCE_LENGTH


class WanE2VPipeline(WanImageToVideoPipeline):

    @classmethod
    def from_model(cls, model) -> WanE2VPipeline:
        """Assembled from a WanModel's live parts (no copy of the weights), as `WanModel.create_pipeline` does."""
        return cls(tokenizer=model.tokenizer, text_encoder=model.text_encoder, vae=model.vae,
                   scheduler=model.noise_scheduler, transformer=model.transformer, transformer_2=model.transformer_2,
                   image_encoder=model.image_encoder, image_processor=model.image_processor,
                   boundary_ratio=model.boundary_ratio, expand_timesteps=model.expand_timesteps)

    @property
    def _main_transformer(self):
        return self.transformer if self.transformer is not None else self.transformer_2

    @property
    def has_image_branch(self) -> bool:
        config = self._main_transformer.config
        return config.image_dim is not None or config.added_kv_proj_dim is not None

    def __call__(self, e2v_condition: Tensor, image_embeds: Tensor | None = None, **kwargs):
        """`e2v_condition`: (C, T, h, w) or (B, C, T, h, w), C + the VAE's z channels = the transformer's
        in_channels. `image_embeds`: CLIP tokens (L, dim) or (1, L, dim), or None (no image tokens). Every other
        argument is `WanImageToVideoPipeline.__call__`'s, except `image` / `last_image` (the condition replaces them).
        """
        for name in ("image", "last_image"):
            if kwargs.get(name) is not None:
                raise ValueError(f"WanE2VPipeline takes its condition from e2v_condition; do not pass {name}")
            kwargs.pop(name, None)
        if self.config.expand_timesteps:
            raise ValueError("E2V sampling is not supported for expand_timesteps models (Wan 2.2 TI2V-5B)")
        if e2v_condition.dim() == 4:
            e2v_condition = e2v_condition.unsqueeze(0)
        if e2v_condition.dim() != 5:
            raise ValueError(f"e2v_condition must be (C, T, h, w) or (B, C, T, h, w), got {tuple(e2v_condition.shape)}")
        if image_embeds is not None:
            if image_embeds.dim() == 2:
                image_embeds = image_embeds.unsqueeze(0)
            if image_embeds.dim() != 3 or image_embeds.shape[0] != 1:
                raise ValueError(f"image_embeds must be (L, dim) or (1, L, dim), got {tuple(image_embeds.shape)}")
            if not self.has_image_branch:
                raise ValueError("image_embeds given, but the transformer has no image branch (image_dim is None)")
        if self.has_image_branch:
            # image tokens are split off as "all but the last 512": text must be exactly 512 tokens
            if kwargs.get("max_sequence_length", TEXT_SEQUENCE_LENGTH) != TEXT_SEQUENCE_LENGTH:
                raise ValueError(f"a transformer with an image branch needs max_sequence_length "
                                 f"{TEXT_SEQUENCE_LENGTH}")
            for name in ("prompt_embeds", "negative_prompt_embeds"):
                embeds = kwargs.get(name)
                if embeds is not None and embeds.shape[1] != TEXT_SEQUENCE_LENGTH:
                    raise ValueError(f"{name} has {embeds.shape[1]} tokens; a transformer with an image branch needs "
                                     f"exactly {TEXT_SEQUENCE_LENGTH}")
        height, width = kwargs.get("height", 480), kwargs.get("width", 832)
        placeholder = Image.new("RGB", (width, height), (127, 127, 127))
        self._e2v_inputs = (e2v_condition, image_embeds)
        try:
            return super().__call__(image=placeholder, **kwargs)
        finally:
            del self._e2v_inputs

    def encode_image(self, image, device: torch.device | None = None) -> Tensor:
        """The precomputed CLIP tokens (1, L, dim); (1, 0, dim) when none were given."""
        device = device or self._execution_device
        _, image_embeds = self._e2v_inputs
        if image_embeds is None:
            config = self._main_transformer.config
            return torch.zeros(1, 0, config.image_dim, device=device)
        return image_embeds.to(device)

    def prepare_latents(self, image, batch_size: int, num_channels_latents: int = 16, height: int = 480,
                        width: int = 832, num_frames: int = 81, dtype: torch.dtype | None = None,
                        device: torch.device | None = None, generator=None, latents: Tensor | None = None,
                        last_image=None) -> tuple[Tensor, Tensor]:
        """(noise latents as the parent draws them, the E2V condition repeated to `batch_size`)."""
        condition, _ = self._e2v_inputs
        num_latent_frames = (num_frames - 1) // self.vae_scale_factor_temporal + 1
        latent_height = height // self.vae_scale_factor_spatial
        latent_width = width // self.vae_scale_factor_spatial
        shape = (batch_size, num_channels_latents, num_latent_frames, latent_height, latent_width)
        if isinstance(generator, list) and len(generator) != batch_size:
            raise ValueError(f"{len(generator)} generators for a batch of {batch_size}")
        if latents is None:
            latents = randn_tensor(shape, generator=generator, device=device, dtype=dtype)
        else:
            latents = latents.to(device=device, dtype=dtype)

        if tuple(condition.shape[2:]) != shape[2:]:
            raise ValueError(f"the E2V condition covers (T, h, w) = {tuple(condition.shape[2:])}, but {num_frames} "
                             f"frames of {height}x{width} need {shape[2:]}")
        in_channels = self._main_transformer.config.in_channels
        if condition.shape[1] + num_channels_latents != in_channels:
            raise ValueError(f"the E2V condition has {condition.shape[1]} channels; the transformer takes "
                             f"{in_channels} = {num_channels_latents} latent + {in_channels - num_channels_latents} "
                             f"condition channels")
        if condition.shape[0] not in (1, batch_size):
            raise ValueError(f"the E2V condition has a batch of {condition.shape[0]}, the pipeline {batch_size}")
        condition = condition.to(device=device, dtype=dtype)
        if condition.shape[0] != batch_size:
            condition = condition.expand(batch_size, -1, -1, -1, -1)
        return latents, condition
