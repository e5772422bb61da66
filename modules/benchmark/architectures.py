"""Full-size Wan transformer architectures with random weights, for benchmarks (no weights exist offline).

The configs are those of the released Diffusers repositories, as diffusers' `scripts/convert_wan_to_diffusers.py`
writes them (`get_transformer_config`): Wan2.1-T2V-1.3B, Wan2.1-T2V-14B, Wan2.2-TI2V-5B and one expert of
Wan2.2-T2V-A14B (both experts have the 14B shape). `tiny` is the test-sized transformer of
`modules.util.tiny_models` (the wan2.1-t2v tiny model), so the benchmark code runs in seconds in tests.

Weights are never initialised the slow way: the module is built with its parameters on the meta device
(`modules.util.empty_weights`, buffers such as the rope tables stay real), its size is known before any memory
is spent, and `materialize` then allocates each parameter directly in the wanted dtype and device with a cheap
random init (normal with std 1/sqrt(fan_in) for matrices, ones for norm weights, zeros for biases).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from modules.util.enum.WanVariant import WanVariant

TEXT_SEQUENCE_LENGTH = 512

_COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, text_dim=4096, freq_dim=256, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
               rope_max_seq_len=1024, pos_embed_seq_len=None)


@dataclass(frozen=True)
class Architecture:
    name: str
    description: str
    variant: WanVariant
    transformer: dict                   # WanTransformer3DModel kwargs
    z_dim: int                          # VAE latent channels
    vae_spatial_stride: int             # 8 (Wan 2.1 VAE) or 16 (Wan 2.2 VAE)
    vae_temporal_stride: int = 4
    expand_timesteps: bool = False      # TI2V-5B: one timestep per token
    boundary_ratio: float | None = None
    expert: str = "high"                # for two-expert variants: the expert that trains
    extra: dict = field(default_factory=dict)

    @property
    def dim(self) -> int:
        if "dim" in self.transformer:   # WanAnimate2Transformer3DModel names its width
            return self.transformer["dim"]
        return self.transformer["num_attention_heads"] * self.transformer["attention_head_dim"]

    @property
    def text_dim(self) -> int:
        return self.transformer["text_dim"]

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(channels, T, h, w) of the VAE latents of a frames x height x width clip."""
        if (frames - 1) % self.vae_temporal_stride:
            raise ValueError(f"frames must be {self.vae_temporal_stride}k+1, got {frames}")
        unit = self.spatial_unit
        if height % unit or width % unit:
            raise ValueError(f"{self.name}: height and width must be multiples of {unit} (VAE stride "
                             f"{self.vae_spatial_stride} x patch 2); got {height}x{width}")
        return (self.z_dim, (frames - 1) // self.vae_temporal_stride + 1, height // self.vae_spatial_stride,
                width // self.vae_spatial_stride)

    @property
    def spatial_unit(self) -> int:
        return self.vae_spatial_stride * self.transformer["patch_size"][1]


def _arch(name, description, variant, z_dim, stride, **transformer) -> Architecture:
    extra = {k: transformer.pop(k) for k in ("expand_timesteps", "boundary_ratio") if k in transformer}
    config = {**_COMMON, **transformer}
    return Architecture(name, description, variant, config, z_dim, stride, **extra)


def _tiny() -> Architecture:
    from modules.util.tiny_models import SPECS, transformer_config
    return Architecture("tiny", "the tiny wan2.1-t2v test transformer (modules.util.tiny_models)", WanVariant.T2V,
                        transformer_config(SPECS["wan2.1-t2v"]), z_dim=16, vae_spatial_stride=8)


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    _arch("wan2.1-1.3b", "Wan2.1-T2V-1.3B", WanVariant.T2V, 16, 8, num_attention_heads=12, ffn_dim=8960,
          num_layers=30, in_channels=16, out_channels=16),
    _arch("wan2.1-14b", "Wan2.1-T2V-14B", WanVariant.T2V, 16, 8, num_attention_heads=40, ffn_dim=13824,
          num_layers=40, in_channels=16, out_channels=16),
    _arch("wan2.2-5b", "Wan2.2-TI2V-5B (48-channel VAE, stride 16, per-token timesteps)", WanVariant.TI2V_5B, 48, 16,
          num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48,
          expand_timesteps=True),
    _arch("wan2.2-a14b-expert", "one expert (high noise) of Wan2.2-T2V-A14B", WanVariant.T2V_A14B, 16, 8,
          num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16, out_channels=16,
          boundary_ratio=0.875),
)}
VARIANT_NAMES = (*ARCHITECTURES, "tiny")


def get_architecture(name: str) -> Architecture:
    if name == "tiny":
        return _tiny()
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"unknown benchmark variant {name!r}; one of {', '.join(VARIANT_NAMES)}") from None


# ------------------------------------------------------------------------------------------------ building

def build_empty_transformer(arch: Architecture):
    """The transformer with its parameters on the meta device (no memory spent; buffers are real)."""
    from modules.util.empty_weights import empty_weights
    from diffusers import WanTransformer3DModel

    with empty_weights():
        return WanTransformer3DModel(**arch.transformer)


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@torch.no_grad()
def materialize(module: torch.nn.Module, dtype: torch.dtype, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """Replaces every meta parameter by a real one of `dtype` on `device`, with a cheap random init."""
    generator = torch.Generator(device=device).manual_seed(seed)
    for module_name, sub in module.named_modules():
        for name, parameter in list(sub._parameters.items()):
            if parameter is None:
                continue
            data = torch.empty(parameter.shape, dtype=dtype, device=device)
            if name == "scale_shift_table":
                data.normal_(0.0, 1.0 / math.sqrt(parameter.shape[-1]), generator=generator)
            elif parameter.ndim >= 2:
                fan_in = math.prod(parameter.shape[1:])
                data.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=generator)
            elif name == "bias":
                data.zero_()
            else:  # norm weights
                data.fill_(1.0)
            sub._parameters[name] = torch.nn.Parameter(data, requires_grad=False)
    return module.to(device)


def vae_stub(arch: Architecture) -> SimpleNamespace:
    """What `WanModel.normalize_latents` and the stride properties read from the VAE, without building it.

    The 16-channel statistics are diffusers' AutoencoderKLWan defaults (the Wan 2.1 VAE's); the 48-channel VAE
    gets mean 0 / std 1 (the values only shift and scale random latents; the cost is the same)."""
    if arch.z_dim == 16:
        from diffusers import AutoencoderKLWan
        defaults = inspect.signature(AutoencoderKLWan.__init__).parameters
        mean, std = list(defaults["latents_mean"].default), list(defaults["latents_std"].default)
    else:
        mean, std = [0.0] * arch.z_dim, [1.0] * arch.z_dim
    config = SimpleNamespace(z_dim=arch.z_dim, latents_mean=mean, latents_std=std,
                             scale_factor_spatial=arch.vae_spatial_stride,
                             scale_factor_temporal=arch.vae_temporal_stride)
    return SimpleNamespace(config=config, dtype=torch.float32)


def make_wan_model(arch: Architecture, transformer) -> object:
    from modules.model.WanModel import WanModel
    return WanModel(variant=arch.variant, vae=vae_stub(arch), transformer=transformer,
                    boundary_ratio=arch.boundary_ratio, expand_timesteps=arch.expand_timesteps,
                    source=f"benchmark:{arch.name}")
