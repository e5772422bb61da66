from typing import Literal

from pydantic import Field, field_validator

from modules.util.config.BaseConfig import BaseConfig


class OptimizerConfig(BaseConfig):
    optimizer: Literal["ADAMW", "ADAMW_8BIT", "LION_8BIT", "ADAFACTOR", "PRODIGY"] = "ADAMW"
    learning_rate: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.01, ge=0)
    eps: float = Field(1e-8, gt=0)
    scheduler: Literal["CONSTANT", "CONSTANT_WITH_WARMUP", "COSINE", "LINEAR"] = "CONSTANT"
    warmup_steps: int = Field(0, ge=0)
    gradient_accumulation_steps: int = Field(1, ge=1)
    clip_grad_norm: float | None = Field(1.0, gt=0)
    ema: bool = False
    ema_decay: float = Field(0.999, gt=0, lt=1)


class TimestepConfig(BaseConfig):
    """How training draws sigmas (modules/modelSetup/timestep_sampling.py; docs/configuration.md plots them).

    `sigmoid_shift` is musubi-tuner's `--timestep_sampling shift`: sigmoid(sigmoid_scale * N(0, 1)), then the flow
    shift; `uniform_shift` draws uniformly, then shifts (what this project's `shift` meant before config version 2).
    The bare name `shift` is refused as ambiguous."""

    distribution: Literal["uniform", "logit_normal", "sigmoid", "uniform_shift", "sigmoid_shift"] = "sigmoid_shift"
    shift: float = Field(3.0, gt=0, description="the flow shift s of uniform_shift / sigmoid_shift: "
                                               "sigma' = s*sigma / (1 + (s-1)*sigma)")
    logit_mean: float = 0.0
    logit_std: float = Field(1.0, gt=0)
    sigmoid_scale: float = Field(1.0, gt=0, description="sigmoid and sigmoid_shift: the scale of the normal draw")
    min_sigma: float = Field(0.0, ge=0, le=1)
    max_sigma: float = Field(1.0, ge=0, le=1)

    @field_validator("distribution", mode="before")
    @classmethod
    def _not_ambiguous(cls, value):
        if value == "shift":
            raise ValueError("'shift' is ambiguous: 'sigmoid_shift' is musubi-tuner's shift (sigmoid of a normal "
                             "draw, then shifted; the presets' choice), 'uniform_shift' draws uniformly, then "
                             "shifts (this project's 'shift' before config version 2)")
        return value
