from typing import Annotated, Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig


class OptimizerConfig(BaseConfig):
    optimizer: Literal["ADAMW", "ADAMW_8BIT", "LION_8BIT", "ADAFACTOR", "PRODIGY"] = "ADAMW"
    learning_rate: float = Field(1e-4, gt=0)
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
    distribution: Literal["uniform", "logit_normal", "sigmoid", "shift"] = "shift"
    shift: float = Field(3.0, gt=0, description="discrete flow shift for the 'shift' distribution")
    logit_mean: float = 0.0
    logit_std: float = Field(1.0, gt=0)
    sigmoid_scale: float = Field(1.0, gt=0)
    min_sigma: float = Field(0.0, ge=0, le=1)
    max_sigma: float = Field(1.0, ge=0, le=1)
