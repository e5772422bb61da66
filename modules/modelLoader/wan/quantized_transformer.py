"""A transformer with nf4 or int8 frozen weights through bitsandbytes (QLoRA), computed in bfloat16: read from a
diffusers folder by both loaders (a base folder and subfolder, or a part folder)."""
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from modules.modelLoader.wan.parts.tensor_files import ModelFileError
from modules.util.config.ModelConfig import PartConfig
from modules.util.enum.DataType import DataType


def load_quantized_transformer(part: PartConfig, base: str = "", subfolder: str = "transformer",
                               common: dict | None = None) -> WanTransformer3DModel:
    """`part.path` (a diffusers transformer folder, or a model folder holding `subfolder`), else `base`'s
    `subfolder`; the model lands on the GPU as it loads (performance_checks refused this on a CPU before anything
    loaded)."""
    from diffusers import BitsAndBytesConfig
    if part.path and Path(part.path).is_file():
        raise ModelFileError(f"model.{subfolder}.path: {part.weight_dtype} weights load from a diffusers folder, "
                             f"not a single file")
    if part.weight_dtype is DataType.NF4:
        quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                          bnb_4bit_compute_dtype=torch.bfloat16)
    else:
        quantization = BitsAndBytesConfig(load_in_8bit=True)
    source, extra = (part.path, {}) if part.path else (base, dict(subfolder=subfolder, **(common or {})))
    if part.path and not (Path(part.path) / "config.json").is_file():
        extra = dict(subfolder=subfolder, local_files_only=True)
    return WanTransformer3DModel.from_pretrained(source, quantization_config=quantization,
                                                 torch_dtype=torch.bfloat16, **extra)
