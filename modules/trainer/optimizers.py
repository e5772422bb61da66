"""Optimizers, learning-rate schedules and EMA from the config."""
import math

import torch

from modules.util.config.OptimizerConfig import OptimizerConfig


def create_optimizer(config: OptimizerConfig,
                     parameters: list[torch.nn.Parameter] | list[dict]) -> torch.optim.Optimizer:
    """`parameters`: the parameters, or parameter groups (modules/trainer/parameter_groups.py), each with its lr."""
    kwargs = dict(lr=config.learning_rate, weight_decay=config.weight_decay)
    if config.optimizer == "ADAMW":
        # fused kernels exist for CUDA tensors only
        flat = [p for g in parameters for p in g["params"]] if isinstance(parameters[0], dict) else parameters
        fused = all(p.is_cuda for p in flat)
        return torch.optim.AdamW(parameters, betas=config.betas, eps=config.eps, fused=fused or None, **kwargs)
    if config.optimizer == "ADAMW_8BIT":
        import bitsandbytes
        return bitsandbytes.optim.AdamW8bit(parameters, betas=config.betas, eps=config.eps, **kwargs)
    if config.optimizer == "LION_8BIT":
        import bitsandbytes
        return bitsandbytes.optim.Lion8bit(parameters, betas=config.betas, **kwargs)
    if config.optimizer == "ADAFACTOR":
        return torch.optim.Adafactor(parameters, lr=config.learning_rate, weight_decay=config.weight_decay)
    if config.optimizer == "PRODIGY":
        from prodigyopt import Prodigy
        return Prodigy(parameters, betas=config.betas, eps=config.eps, **kwargs)
    raise ValueError(f"optimizer.optimizer: unknown optimizer {config.optimizer!r}")


def lr_factor(config: OptimizerConfig, step: int, total_steps: int) -> float:
    warmup = config.warmup_steps
    if config.scheduler != "CONSTANT" and warmup and step < warmup:
        return (step + 1) / warmup
    if config.scheduler in ("CONSTANT", "CONSTANT_WITH_WARMUP"):
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    if config.scheduler == "COSINE":
        return 0.5 * (1 + math.cos(math.pi * progress))
    return 1.0 - progress  # LINEAR


def create_lr_scheduler(config: OptimizerConfig, optimizer: torch.optim.Optimizer,
                        total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(config, step, total_steps))


class EMA:
    """Exponential moving average of the trainable parameters, kept in float32 on their device."""

    def __init__(self, parameters: list[torch.nn.Parameter], decay: float):
        self.parameters = parameters
        self.decay = decay
        self.shadow = [p.detach().float().clone() for p in parameters]

    @torch.no_grad()
    def update(self) -> None:
        for shadow, parameter in zip(self.shadow, self.parameters):
            shadow.lerp_(parameter.detach().float(), 1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(i): s for i, s in enumerate(self.shadow)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        for i, shadow in enumerate(self.shadow):
            shadow.copy_(state[str(i)])

    @torch.no_grad()
    def copy_to_parameters(self) -> None:
        for shadow, parameter in zip(self.shadow, self.parameters):
            parameter.copy_(shadow.to(parameter.dtype))
