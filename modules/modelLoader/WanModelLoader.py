from modules.model.WanModel import WanModel
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.util.config.ModelConfig import ModelConfig
from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.registry import register


@register("model_loader", [ModelType.WAN_2_1, ModelType.WAN_2_2], list(TrainingMethod))
class WanModelLoader:
    """Loads the base model; adapters and embeddings are loaded by their setups (they need the base first)."""

    def load(self, config: ModelConfig) -> WanModel:
        return WanBaseModelLoader().load(config)
