"""Full or layer-filtered fine-tune of the transformer (one expert for Wan 2.2 A14B)."""
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import Tensor

from modules.model.e2v_file_metadata import write_e2v_folder_config
from modules.model.released_parts import text_encoder_loaded
from modules.modelSaver.WanModelSaver import WanModelSaver
from modules.modelSetup.BaseWanSetup import BaseWanSetup
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.registry import register


@register("model_setup", [ModelType.WAN_2_1, ModelType.WAN_2_2], [TrainingMethod.FINE_TUNE])
class WanFineTuneSetup(BaseWanSetup):
    def setup_model(self) -> None:
        if self.model.variant.has_two_experts and self.config.expert == "both":
            raise ValueError("expert: a fine-tune trains one expert of a two-expert model; set expert to high or low")
        layer_filter = self.config.fine_tune.layer_filter
        frozen = self.model.variant.frozen_transformer_parts
        for name, parameter in self._named_transformer_parameters():
            if layer_filter:
                parameter.requires_grad_(any(f in name for f in layer_filter))
            else:
                parameter.requires_grad_(not name.split(".", 1)[1].startswith(frozen) if frozen else True)
        if not self.trainable_parameters():
            raise ValueError(f"fine_tune.layer_filter {layer_filter} matches no transformer parameter")
        for parameter in self.trainable_parameters():
            # the trained weights are held in float32 (mixed precision comes from autocast)
            parameter.data = parameter.data.float()
        self.apply_performance()

    def _named_transformer_parameters(self):
        for expert in self.experts_in_training():
            for name, parameter in getattr(self.model, expert).named_parameters():
                yield f"{expert}.{name}", parameter

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self._named_transformer_parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self._named_transformer_parameters() if p.requires_grad]

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self._named_transformer_parameters() if p.requires_grad}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        for name, parameter in self._named_transformer_parameters():
            if parameter.requires_grad:
                parameter.data.copy_(state[name])

    def save_result(self, destination: str, output_format: ModelFormat, dtype: torch.dtype | None,
                    train_config: dict | None) -> list[Path]:
        # a diffusers folder holds every part: the text encoder released after caching is read again for it
        with text_encoder_loaded(self.model) if output_format is ModelFormat.DIFFUSERS else nullcontext():
            written = WanModelSaver().save(self.model, output_format, destination, dtype, train_config)
        if output_format is ModelFormat.DIFFUSERS:
            write_e2v_folder_config(self.model, destination)  # an E2V model's layout, beside its parts
        return written
