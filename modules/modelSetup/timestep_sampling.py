"""Flow-matching sigma distributions, restricted to a range while keeping their shape (DESIGN.md section 4)."""
import torch
from torch import Tensor

from modules.util.config.OptimizerConfig import TimestepConfig


def _shift(sigma: Tensor, shift: float) -> Tensor:
    # Wan's discrete flow shift, as FlowMatch schedulers apply it at inference
    return shift * sigma / (1 + (shift - 1) * sigma)


def _draw(config: TimestepConfig, count: int, generator: torch.Generator) -> Tensor:
    if config.distribution == "uniform":
        return torch.rand(count, generator=generator)
    if config.distribution == "logit_normal":
        return torch.sigmoid(config.logit_mean + config.logit_std * torch.randn(count, generator=generator))
    if config.distribution == "sigmoid":
        return torch.sigmoid(config.sigmoid_scale * torch.randn(count, generator=generator))
    if config.distribution == "uniform_shift":
        return _shift(torch.rand(count, generator=generator), config.shift)
    if config.distribution == "sigmoid_shift":
        # musubi-tuner's "shift" (training/trainer_base.py get_noisy_model_input_and_timesteps)
        return _shift(torch.sigmoid(config.sigmoid_scale * torch.randn(count, generator=generator)), config.shift)
    raise ValueError(f"unknown timestep distribution {config.distribution!r}")


def sample_sigmas(config: TimestepConfig, batch_size: int, generator: torch.Generator,
                  low: float = 0.0, high: float = 1.0, include_high: bool = True) -> Tensor:
    """Sigmas of the configured distribution conditioned on [max(low, min_sigma), min(high, max_sigma)]: rejection
    sampling keeps the distribution's shape inside the range (an expert sees the same density it would see in
    the whole-model schedule). `include_high=False` makes the range half-open, for the low-noise expert."""
    low, high = max(low, config.min_sigma), min(high, config.max_sigma)
    if low >= high:
        raise ValueError(f"empty sigma range [{low}, {high}]: check timestep.min_sigma / max_sigma and the expert")
    accepted: list[Tensor] = []
    have = 0
    for _ in range(1000):
        draw = _draw(config, max(64, batch_size * 8), generator)
        keep = draw[(draw >= low) & ((draw <= high) if include_high else (draw < high))]
        accepted.append(keep)
        have += keep.numel()
        if have >= batch_size:
            return torch.cat(accepted)[:batch_size]
    raise ValueError(f"the {config.distribution} distribution almost never falls in [{low}, {high}]")

