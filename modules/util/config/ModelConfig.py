from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import PathText, WritePath
from modules.util.enum.DataType import DataType
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.WanVariant import WanVariant


class PartConfig(BaseConfig):
    """One part of the model: an optional override of where it comes from, and the dtype its weights are held in."""

    path: PathText = Field("", description="a diffusers folder (or its subfolder) or a single file; empty: the base model's")
    weight_dtype: DataType = DataType.FLOAT_32


class TokenizerConfig(BaseConfig):
    """Where the UMT5 tokenizer comes from when the base model does not hold it (ComfyUI files)."""

    path: PathText = Field("", description="a tokenizer folder (google/umt5-xxl: tokenizer.json or spiece.model) or "
                                           "file; empty: found beside the text encoder or in the base model")


class ModelConfig(BaseConfig):
    base_model_name: PathText = Field("", description="a diffusers folder, an official Wan release folder, a folder of "
                                                      "ComfyUI single files, or a hub id when allow_download is true")
    allow_download: bool = False
    intended_variant: WanVariant | None = Field(
        None, description="the Wan variant this config (preset) is made for: T2V, I2V, FLF2V, TI2V_5B, T2V_A14B, "
                          "I2V_A14B; training refuses a model of another variant; null: any")
    transformer: PartConfig = PartConfig()
    transformer_2: PartConfig = PartConfig()
    vae: PartConfig = PartConfig()
    text_encoder: PartConfig = PartConfig()
    image_encoder: PartConfig = PartConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()


class OutputConfig(BaseConfig):
    destination: WritePath = "workspace/output/model.safetensors"
    format: ModelFormat = ModelFormat.COMFY_LORA
    dtype: DataType = DataType.BFLOAT_16
