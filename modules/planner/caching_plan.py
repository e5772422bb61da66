"""The caching pass planned like the training step: the VAE encoding one clip of the largest bucket (with or without
`performance.vae_tiling`) and the UMT5-XXL text encoder encoding one 512-token prompt, each alone on the device
(caching runs one encoder at a time, then moves it back to the CPU). Fake tensors, counted by StorageCounter."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from modules.planner.StorageCounter import StorageCounter
from modules.util.config.TrainConfig import TrainConfig

TEXT_TOKENS = 512
UMT5_CONFIG = Path(__file__).resolve().parents[2] / "resources" / "wan_configs" / "encoders" / "umt5-xxl.json"


@dataclass
class CachingPlan:
    vae_bytes: int          # weights + the encode's peak
    vae_tiling: bool
    text_encoder_bytes: int

    @property
    def peak_bytes(self) -> int:
        return max(self.vae_bytes, self.text_encoder_bytes)


def _fake_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    for sub in module.modules():
        for name, parameter in list(sub._parameters.items()):
            if parameter is not None:
                sub._parameters[name] = torch.nn.Parameter(torch.empty(parameter.shape, dtype=dtype),
                                                           requires_grad=False)


def _trace(build, run, dtype: torch.dtype) -> int:
    from modules.util.empty_weights import empty_weights
    from torch._subclasses.fake_tensor import FakeTensorMode
    with empty_weights():
        module = build()
    counter = StorageCounter("cpu")
    with FakeTensorMode(allow_non_fake_inputs=True), counter, torch.no_grad():
        _fake_parameters(module, dtype)
        run(module)
    return counter.peak


def plan_caching(config: TrainConfig, arch, shape) -> CachingPlan:
    from diffusers import AutoencoderKLWan
    vae_config = {k: v for k, v in (arch.extra.get("vae") or {}).items() if not k.startswith("_")}
    vae_dtype = torch.float32 if config.model.vae.weight_dtype.value == "FLOAT_32" else torch.bfloat16
    tiling = config.performance.vae_tiling

    def encode(vae):
        if tiling:
            vae.enable_tiling()
        vae.encode(torch.empty(1, 3, shape.frames, shape.height, shape.width, dtype=vae_dtype)).latent_dist.mode()

    vae_bytes = _trace(lambda: AutoencoderKLWan(**vae_config), encode, vae_dtype)

    from transformers import UMT5Config, UMT5EncoderModel
    text_config = UMT5Config(**json.loads(UMT5_CONFIG.read_text(encoding="utf-8")))
    # a float8 text encoder is planned in bf16 (an upper bound: its weights take one byte each, not two)
    text_dtype = torch.float32 if config.model.text_encoder.weight_dtype.value == "FLOAT_32" else torch.bfloat16

    def embed(encoder):
        encoder(input_ids=torch.zeros(1, TEXT_TOKENS, dtype=torch.long),
                attention_mask=torch.ones(1, TEXT_TOKENS, dtype=torch.long))

    text_bytes = _trace(lambda: UMT5EncoderModel(text_config), embed, text_dtype)
    return CachingPlan(vae_bytes, tiling, text_bytes)


def plan_caching_of(config: TrainConfig) -> CachingPlan:
    """plan_caching at the run's architecture and largest bucket (a trace_pool job: its arguments are pickled)."""
    from modules.planner.plan_shapes import largest_shape, resolve_architecture
    arch = resolve_architecture(config)
    return plan_caching(config, arch, largest_shape(config, arch))
