from typing import Literal

from pydantic import Field, field_validator, model_validator

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import MAX_LEARNING_RATE, MAX_LR_RATIO, MAX_RANK, PathText
from modules.util.lora.targets import LoraTargetError, custom_target_regex


class LoraConfig(BaseConfig):
    type: Literal["LORA", "LOHA", "LOKR"] = Field(
        "LORA", description="LORA, or LyCORIS' LOHA (Hadamard product of two low-rank products) / LOKR (Kronecker "
                            "product); LOHA / LOKR save as COMFY_LORA or KOHYA_LORA only")
    rank: int = Field(32, ge=1, le=MAX_RANK, description="at most the width of the narrowest targeted layer")
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1, description="LORA: input dropout; LOHA / LOKR (peft has no input "
                                                         "dropout for them): rank dropout of the weight delta")
    decompose_factor: int = Field(-1, le=MAX_RANK, description="LOKR: the size of the smaller Kronecker factor of each dimension; "
                                                  "-1: as near the square root as divides it")
    decompose_both: bool = Field(False, description="LOKR: also factorise the smaller Kronecker factor into rank-r "
                                                    "matrices")
    targets: Literal["attn-only", "attn-mlp", "blocks-full", "vace", "custom"] = "attn-mlp"
    custom_targets: list[str] = Field([], description="module names or one regex, used when targets is 'custom'")
    face_adapter: bool = Field(False, description="Wan2.2-Animate: also adapt the face adapter blocks (their query, "
                                                  "key, value and output projections); the motion and face "
                                                  "encoders stay frozen")
    dora: bool = False
    plus_lr_ratio: float = Field(1.0, ge=1, le=MAX_LR_RATIO, description="LoRA+: the B (up) matrices learn at this "
                                 "multiple of optimizer.learning_rate (16 in the LoRA+ paper; 1: off). LORA and DoRA "
                                 "only (DoRA's magnitudes keep the base rate)")
    init_from: PathText = Field("", description="an existing LoRA file to continue training")

    @model_validator(mode="after")
    def _check_type(self):
        if self.dora and self.type != "LORA":
            raise ValueError(f"lora.dora: DoRA is available with lora.type LORA only, not {self.type}")
        if self.plus_lr_ratio != 1 and self.type != "LORA":
            raise ValueError(f"lora.plus_lr_ratio: LoRA+ speeds up LoRA's zero-initialised B (up) matrices; "
                             f"{self.type} has no such matrix (its factors are all products of one another): set "
                             f"it to 1 or use lora.type LORA")
        if self.decompose_factor == 0 or self.decompose_factor < -1:
            raise ValueError(f"lora.decompose_factor: -1 or a positive integer, not {self.decompose_factor}")
        if self.face_adapter and self.type != "LORA":
            raise ValueError(f"lora.face_adapter: the official and ComfyUI layouts stack the face adapter's key and "
                             f"value in one Linear, which a LoRA adapter stacks exactly and {self.type} does not: "
                             f"use lora.type LORA, or leave lora.face_adapter off")
        if self.targets == "custom" and not self.custom_targets:
            raise ValueError("lora.custom_targets: empty, but lora.targets is 'custom' (list module names, or one "
                             "regex matched against the whole name)")
        return self

    @field_validator("custom_targets")
    @classmethod
    def _compiles(cls, value: list[str]) -> list[str]:
        try:
            custom_target_regex(value)
        except LoraTargetError as error:
            raise ValueError(str(error).removeprefix("lora.custom_targets: ")) from None
        if any(not target.strip() for target in value):
            raise ValueError("an empty module name")
        return value


class FineTuneConfig(BaseConfig):
    layer_filter: list[str] = Field([], description="train only parameters whose names contain one of these")
    # per-part learning rates: separate optimizer parameter groups (modules/trainer/parameter_groups.py)
    blocks_learning_rate: float | None = Field(None, gt=0, le=MAX_LEARNING_RATE,
                                               description="the transformer blocks' learning rate; "
                                               "empty: optimizer.learning_rate")
    embeddings_learning_rate: float | None = Field(None, gt=0, le=MAX_LEARNING_RATE,
                                                   description="the patch, time, text and image "
                                                   "embedders' learning rate; empty: optimizer.learning_rate")
    heads_learning_rate: float | None = Field(None, gt=0, le=MAX_LEARNING_RATE,
                                              description="the output norm, scale-shift table and "
                                              "projection's learning rate; empty: optimizer.learning_rate")


class EmbeddingConfig(BaseConfig):
    placeholder: str = "<wan-emb>"
    initial_text: str = "*"
    vector_count: int = Field(1, ge=1, le=1024)
