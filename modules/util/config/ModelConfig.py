from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig
from modules.util.enum.DataType import DataType
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.WanVariant import WanVariant


class PartConfig(BaseConfig):
    """One part of the model: an optional override of where it comes from, and the dtype its weights are held in."""

    path: str = Field("", description="a diffusers folder (or its subfolder) or a single file; empty: the base model's")
    weight_dtype: DataType = DataType.FLOAT_32


class ModelConfig(BaseConfig):
    base_model_name: str = Field("", description="a diffusers folder, or a hub id when allow_download is true")
    allow_download: bool = False
    intended_variant: WanVariant | None = Field(
        None, description="the Wan variant this config (preset) is made for: T2V, I2V, FLF2V, TI2V_5B, T2V_A14B, "
                          "I2V_A14B; training refuses a model of another variant; null: any")
    transformer: PartConfig = PartConfig()
    transformer_2: PartConfig = PartConfig()
    vae: PartConfig = PartConfig()
    text_encoder: PartConfig = PartConfig()
    image_encoder: PartConfig = PartConfig()


class OutputConfig(BaseConfig):
    destination: str = "workspace/output/model.safetensors"
    format: ModelFormat = ModelFormat.COMFY_LORA
    dtype: DataType = DataType.BFLOAT_16
