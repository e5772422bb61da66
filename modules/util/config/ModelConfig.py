from pydantic import Field, field_validator

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import PathText, WritePath
from modules.util.enum.DataType import DataType
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.WanVariant import WanVariant


class PartConfig(BaseConfig):
    """One part of the model: an optional override of where it comes from, and the dtype its weights are held in."""

    path: PathText = Field("", description="a diffusers folder (or its subfolder) or a single file; empty: the base model's")
    weight_dtype: DataType = DataType.FLOAT_32


class ImageEncoderConfig(PartConfig):
    """The CLIP vision model of E2V's clip / dual pathway (`train --image_encoder`)."""

    path: PathText = Field("", description="a diffusers folder with image_encoder/ (a Wan 2.1 I2V folder), a CLIP "
                           "vision folder or file (clip_vision_h.safetensors), or a hub id (with allow_download); "
                           "empty: the base's own, or for a base named by hub id Wan 2.1 I2V's (docs/e2v.md)")


class TokenizerConfig(BaseConfig):
    """Where the UMT5 tokenizer comes from when the base model does not hold it (ComfyUI files)."""

    path: PathText = Field("", description="a tokenizer folder (google/umt5-xxl: tokenizer.json or spiece.model) or "
                                           "file; empty: found beside the text encoder or in the base model")


class ModelConfig(BaseConfig):
    base_model_name: PathText = Field("", description="a diffusers folder, an official Wan release folder, a folder of "
                                                      "ComfyUI single files, or a hub id when allow_download is true")
    allow_download: bool = False
    intended_variant: WanVariant | None = Field(
        None, description="the Wan variant this config (preset) is made for: "
                          + ", ".join(variant.value for variant in WanVariant)
                          + "; training refuses a model of another variant; null: any")
    transformer: PartConfig = PartConfig()
    transformer_2: PartConfig = PartConfig()
    vae: PartConfig = PartConfig()
    text_encoder: PartConfig = PartConfig()
    image_encoder: ImageEncoderConfig = ImageEncoderConfig()

    @field_validator("image_encoder", mode="before")
    @classmethod
    def _any_part_config(cls, value):
        # a plain PartConfig (the type this field had before) is taken as it is
        return value.model_dump() if isinstance(value, PartConfig) and not isinstance(value, ImageEncoderConfig) \
            else value
    tokenizer: TokenizerConfig = TokenizerConfig()


class OutputConfig(BaseConfig):
    destination: WritePath = "workspace/output/model.safetensors"
    format: ModelFormat = ModelFormat.COMFY_LORA
    dtype: DataType = DataType.BFLOAT_16
