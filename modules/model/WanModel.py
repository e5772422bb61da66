"""WanModel: a plain container of the parts of a Wan model, plus the encode/normalise/condition functions that the
data loader, the training setups and the sampler all share (a mismatch between training and inference is the most
common bug in this field, so there is exactly one implementation of each)."""
from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKLWan, WanTransformer3DModel
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from torch import Tensor

from modules.model.clip_pixels import images_clip_tokens
from modules.model.sampling_defaults import SamplingDefaults
from modules.util.enum.ModelType import ModelType
from modules.util.enum.WanVariant import WanVariant

# Models with an image branch split image from text tokens as "all but the last 512" (see DESIGN.md 6.9).
TEXT_SEQUENCE_LENGTH = 512


@dataclass
class WanModel:
    variant: WanVariant
    tokenizer: object = None
    text_encoder: torch.nn.Module | None = None
    vae: AutoencoderKLWan | None = None
    transformer: WanTransformer3DModel | None = None
    transformer_2: WanTransformer3DModel | None = None
    image_encoder: torch.nn.Module | None = None
    image_processor: object = None
    noise_scheduler: object = None
    boundary_ratio: float | None = None
    expand_timesteps: bool = False
    # an official-release / ComfyUI base: the variant's official sampling settings (None for a diffusers folder,
    # whose scheduler config is its own)
    sampling_defaults: SamplingDefaults | None = None
    # Where the weights came from, for modelspec metadata and cache keys.
    source: str = ""
    # one line per part read from files (file, layout, dtype), for the run plan; empty for a diffusers folder
    part_messages: list[str] = field(default_factory=list)
    # E2V: the dataset config whose condition layout the model learns, and the parameters an expansion added or
    # widened (they train fully, also under LoRA, and are saved with the adapter)
    e2v_config: object = None
    e2v_trainable: list[str] = field(default_factory=list)
    # reads the text encoder again once it was released after caching (modules/model/released_parts.py)
    text_encoder_loader: object = None
    # prompt -> its (max_length, D) embeddings, kept for previews once the text encoder is released (released_parts)
    prompt_memo: dict = field(default_factory=dict)

    @property
    def model_type(self) -> ModelType:
        return self.variant.model_type

    @property
    def main_transformer(self) -> WanTransformer3DModel:
        return self.transformer if self.transformer is not None else self.transformer_2

    @property
    def vae_temporal_stride(self) -> int:
        return int(self.vae.config.scale_factor_temporal)

    @property
    def vae_spatial_stride(self) -> int:
        return int(self.vae.config.scale_factor_spatial)

    @property
    def spatial_unit(self) -> int:
        return self.vae_spatial_stride * int(self.main_transformer.config.patch_size[1])

    @property
    def latent_channels(self) -> int:
        return int(self.vae.config.z_dim)

    @property
    def uses_image_tokens(self) -> bool:
        return self.main_transformer.config.image_dim is not None

    def parts(self) -> dict[str, torch.nn.Module]:
        named = {"text_encoder": self.text_encoder, "vae": self.vae, "transformer": self.transformer,
                 "transformer_2": self.transformer_2, "image_encoder": self.image_encoder}
        return {name: module for name, module in named.items() if module is not None}

    # ---- text -------------------------------------------------------------------------------------------------

    def tokenize(self, prompts: list[str], max_length: int = TEXT_SEQUENCE_LENGTH) -> tuple[Tensor, Tensor]:
        tokens = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=max_length,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        return tokens.input_ids, tokens.attention_mask

    def encode_text(self, prompts: list[str], max_length: int = TEXT_SEQUENCE_LENGTH) -> Tensor:
        """UMT5 hidden states (B, max_length, D), padding positions zeroed exactly as diffusers' Wan pipelines do."""
        from modules.model.released_parts import text_encoder_loaded
        if max_length == TEXT_SEQUENCE_LENGTH and prompts and all(p in self.prompt_memo for p in prompts):
            return torch.stack([self.prompt_memo[p] for p in prompts])
        input_ids, mask = self.tokenize(prompts, max_length)
        with text_encoder_loaded(self):   # released after caching: a prompt the cache lacks reads it again
            device = next(self.text_encoder.parameters()).device
            hidden = self.text_encoder(input_ids.to(device), mask.to(device)).last_hidden_state
        # (B, L, D) -> zero every position past the prompt's own length
        return hidden * mask.to(device=device, dtype=hidden.dtype).unsqueeze(-1)

    # ---- images (CLIP pathway) --------------------------------------------------------------------------------

    def encode_image(self, images: list) -> Tensor:
        """CLIP vision hidden_states[-2] for each image (PIL or uint8 (H, W, 3)): (N, tokens, dim), each image
        squashed to the encoder's size as the official Wan code does (clip_pixels; diffusers' processor crops)."""
        return images_clip_tokens(self.image_encoder, images)

    # ---- latents ----------------------------------------------------------------------------------------------

    def _latent_stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        shape = (1, self.latent_channels, 1, 1, 1)
        mean = torch.tensor(self.vae.config.latents_mean, device=like.device, dtype=like.dtype).view(shape)
        std = torch.tensor(self.vae.config.latents_std, device=like.device, dtype=like.dtype).view(shape)
        return mean, std

    def normalize_latents(self, latents: Tensor) -> Tensor:
        mean, std = self._latent_stats(latents)
        return (latents - mean) / std

    def denormalize_latents(self, latents: Tensor) -> Tensor:
        mean, std = self._latent_stats(latents)
        return latents * std + mean

    def encode_video(self, video: Tensor) -> Tensor:
        """(B, 3, F, H, W) in [-1, 1] -> raw (unnormalised) VAE posterior mean (B, z, T, H/s, W/s)."""
        vae_param = next(self.vae.parameters())
        video = video.to(device=vae_param.device, dtype=vae_param.dtype)
        return self.vae.encode(video).latent_dist.mode()

    def decode_latents(self, normalized: Tensor) -> Tensor:
        """Normalised latents -> video (B, 3, F, H, W) in [-1, 1]."""
        vae_param = next(self.vae.parameters())
        latents = self.denormalize_latents(normalized.to(device=vae_param.device, dtype=vae_param.dtype))
        return self.vae.decode(latents).sample.clamp(-1, 1)

    # ---- image conditions (I2V, FLF2V, E2V) -------------------------------------------------------------------

    def fold_frame_mask(self, pixel_mask: Tensor, latent_height: int, latent_width: int) -> Tensor:
        """Pixel-frame mask (B, F) -> (B, stride, T, h, w) as Wan I2V folds it: m[0] repeated `stride` times,
        then m[1:], viewed as (T, stride) and transposed."""
        stride = self.vae_temporal_stride
        batch = pixel_mask.shape[0]
        folded = torch.cat([pixel_mask[:, :1].repeat_interleave(stride, dim=1), pixel_mask[:, 1:]], dim=1)
        # (B, stride*T) -> (B, T, stride) -> (B, stride, T) -> (B, stride, T, h, w)
        folded = folded.view(batch, -1, stride).transpose(1, 2)
        return folded[:, :, :, None, None].expand(-1, -1, -1, latent_height, latent_width).contiguous()

    def make_condition(self, condition_video: Tensor, pixel_mask: Tensor) -> Tensor:
        """The channels concatenated to the noisy latents of an I2V-style model: cat(folded mask, normalised latents
        of the condition video). `condition_video` (B, 3, F, H, W) in [-1, 1] holds the reference frames and 0
        (mid-grey) elsewhere; `pixel_mask` (B, F) is 1 on reference frames."""
        latents = self.normalize_latents(self.encode_video(condition_video).float())
        mask = self.fold_frame_mask(pixel_mask.to(latents.device, latents.dtype), latents.shape[3], latents.shape[4])
        return torch.cat([mask, latents], dim=1)

    def first_last_condition_video(self, first: Tensor, last: Tensor | None, num_frames: int) -> tuple[Tensor, Tensor]:
        """I2V / FLF2V: the condition video (first frame, zeros, optional last frame) and its pixel-frame mask.
        `first`/`last` are (B, 3, H, W) in [-1, 1]."""
        batch, _, height, width = first.shape
        video = first.new_zeros(batch, 3, num_frames, height, width)
        mask = first.new_zeros(batch, num_frames)
        video[:, :, 0], mask[:, 0] = first, 1
        if last is not None:
            video[:, :, -1], mask[:, -1] = last, 1
        return video, mask

    def expanded_timesteps(self, timestep: Tensor, latents_shape: tuple, clean_first_frame: bool) -> Tensor:
        """Wan 2.2 TI2V-5B: one timestep per token (B, T*h/2*w/2); the first latent frame's tokens get 0 when it is a
        clean image condition, as diffusers' `expand_timesteps` does."""
        batch, _, frames, height, width = latents_shape
        patch = self.main_transformer.config.patch_size
        tokens = torch.ones(frames, height // patch[1], width // patch[2], device=timestep.device)
        if clean_first_frame:
            tokens[0] = 0
        return tokens.flatten()[None, :] * timestep.view(batch, 1).to(tokens.dtype)

    # ---- diffusers pipelines assembled from the live parts (no copy of the weights) -----------------------------

    def create_pipeline(self, image_mode: bool | None = None, with_text_encoder: bool = True):
        """WanPipeline for text-to-video, WanImageToVideoPipeline when the model takes an image (I2V, FLF2V,
        I2V-A14B, or TI2V-5B given `image_mode=True`), WanVACEPipeline for VACE. Without `with_text_encoder` a
        released text encoder stays released (the caller gives the prompts' embeddings)."""
        from diffusers import WanImageToVideoPipeline, WanPipeline
        if with_text_encoder and self.text_encoder is None and self.text_encoder_loader is not None:
            # released after caching: read again and kept, as the pipeline holds it for as long as it lives
            self.text_encoder = self.text_encoder_loader().requires_grad_(False).eval()
        if self.variant.is_vace:
            from diffusers import WanVACEPipeline
            return WanVACEPipeline(tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=self.vae,
                                   scheduler=self.noise_scheduler, transformer=self.transformer,
                                   transformer_2=self.transformer_2, boundary_ratio=self.boundary_ratio)
        if image_mode is None:
            # Wan-Fun Control: saved as the I2V pipeline's parts (CLIP included), as its releases are I2V-shaped
            image_mode = self.variant.takes_image_condition or self.variant.is_fun_control
        common = dict(tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=self.vae,
                      scheduler=self.noise_scheduler, transformer=self.transformer, transformer_2=self.transformer_2,
                      boundary_ratio=self.boundary_ratio, expand_timesteps=self.expand_timesteps)
        if image_mode:
            return WanImageToVideoPipeline(image_encoder=self.image_encoder, image_processor=self.image_processor,
                                           **common)
        return WanPipeline(**common)
