from pathlib import Path

import torch

from modules.model.WanModel import WanModel
from modules.modelSaver.wan.WanBaseModelSaver import WanBaseModelSaver
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.registry import register


@register("model_saver", [ModelType.WAN_2_1, ModelType.WAN_2_2], [TrainingMethod.FINE_TUNE])
class WanModelSaver:
    def save(self, model: WanModel, output_format: ModelFormat, destination: str | Path,
             dtype: torch.dtype | None = None, train_config: dict | None = None) -> list[Path]:
        return WanBaseModelSaver().save(model, output_format, destination, dtype, train_config)
