from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import MAX_LEARNING_RATE


class OptimizerConfig(BaseConfig):
    optimizer: Literal["ADAMW", "ADAMW_8BIT", "LION_8BIT", "ADAFACTOR", "PRODIGY"] = "ADAMW"
    learning_rate: float = Field(1e-4, gt=0, le=MAX_LEARNING_RATE)
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    weight_decay: float = Field(0.01, ge=0)
    eps: float = Field(1e-8, gt=0)
    scheduler: Literal["CONSTANT", "CONSTANT_WITH_WARMUP", "COSINE", "LINEAR"] = "CONSTANT"
    warmup_steps: int = Field(0, ge=0, le=10 ** 12)
    gradient_accumulation_steps: int = Field(1, ge=1, le=65536)
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

    @model_validator(mode="after")
    def _a_range_to_draw_from(self):
        # found here, not as "empty sigma range" from the first training step after the model has loaded
        if self.max_sigma <= self.min_sigma:
            raise ValueError(f"max_sigma ({self.max_sigma:g}) must be above min_sigma ({self.min_sigma:g}): "
                             f"training draws its sigmas from [min_sigma, max_sigma]")
        return self
