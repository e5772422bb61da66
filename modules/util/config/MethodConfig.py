from typing import Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig


class LoraConfig(BaseConfig):
    rank: int = Field(32, ge=1)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: Literal["attn-only", "attn-mlp", "blocks-full", "custom"] = "attn-mlp"
    custom_targets: list[str] = Field([], description="module names or one regex, used when targets is 'custom'")
    dora: bool = False
    init_from: str = Field("", description="an existing LoRA file to continue training")


class FineTuneConfig(BaseConfig):
    layer_filter: list[str] = Field([], description="train only parameters whose names contain one of these")


class EmbeddingConfig(BaseConfig):
    placeholder: str = "<wan-emb>"
    initial_text: str = "*"
    vector_count: int = Field(1, ge=1)
