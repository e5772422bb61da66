"""LoRA (and DoRA), LoHa and LoKr training on the transformer(s) with peft, on diffusers module names.

`lora.type` picks the peft config: LORA -> `peft.LoraConfig`, LOHA -> `peft.LoHaConfig`, LOKR -> `peft.LoKrConfig`,
with the same targets, rank and alpha. peft's LoHa / LoKr have no input dropout: `lora.dropout` becomes their
`rank_dropout`. LoHa / LoKr save in LyCORIS key names (modules/util/lora/lycoris.py) as COMFY_LORA or KOHYA_LORA.
"""
import contextlib
from pathlib import Path

import torch
from peft.helpers import disable_input_dtype_casting
from peft import LoHaConfig, LoKrConfig
from peft import LoraConfig as PeftLoraConfig
from torch import Tensor

from modules.dataLoader.pipeline.PipelineModule import derive_seed
from modules.modelSetup.BaseWanSetup import BaseWanSetup
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.lora.apply import is_adapter_parameter, load_lora_weights_into_peft, lora_weights_from_peft
from modules.util.lora.formats import (diffusers_companion_path, expert_lora_paths, expert_output_paths,
                                       load_lora_file, match_to_model, save_lora_file)
from modules.util.lora.targets import lora_target_names
from modules.util.modelspec import modelspec_metadata
from modules.model.e2v_file_metadata import e2v_file_metadata
from modules.util.config.config_io import ConfigError
from modules.util.expert_metadata import expert_metadata, expert_problem
from modules.model.e2v_lora import save_e2v_lora
from modules.util.registry import register

ADAPTER = "default"


def peft_adapter_config(lora, targets: list[str]):
    """The peft config for `lora` (a LoraConfig section) on the given module names."""
    if lora.type == "LORA":
        return PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets,
                              use_dora=lora.dora, init_lora_weights=True)
    common = dict(r=lora.rank, alpha=lora.alpha, rank_dropout=lora.dropout, module_dropout=0.0,
                  target_modules=targets, init_weights=True)
    if lora.type == "LOHA":
        return LoHaConfig(**common)
    if lora.type == "LOKR":
        return LoKrConfig(**common, decompose_factor=lora.decompose_factor, decompose_both=lora.decompose_both)
    raise ValueError(f"lora.type {lora.type!r}: LORA, LOHA or LOKR")


def check_output_format(lora_type: str, output_format: ModelFormat) -> None:
    if lora_type != "LORA" and ModelFormat(output_format) == ModelFormat.DIFFUSERS_LORA:
        raise ValueError(f"lora.type {lora_type} cannot be saved as DIFFUSERS_LORA (diffusers has no key names for "
                         f"LoHa / LoKr); use output.format COMFY_LORA (LyCORIS names, read by ComfyUI) or KOHYA_LORA")


@register("model_setup", [ModelType.WAN_2_1, ModelType.WAN_2_2], [TrainingMethod.LORA])
class WanLoRASetup(BaseWanSetup):
    def setup_model(self) -> None:
        lora = self.config.lora
        check_output_format(lora.type, self.config.output.format)  # before training, not after
        # E2V: parts an expansion added train fully, so they are not wrapped by the adapter
        self.full_names = set(self.model.e2v_trainable)
        fully_trained_modules = {name.rsplit(".", 1)[0] for name in self.full_names}
        for name in self.experts_in_training():
            transformer = getattr(self.model, name)
            linear_names = [n for n, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)]
            chosen = lora_target_names(linear_names, lora.targets, lora.custom_targets, lora.face_adapter)
            targets = [t for t in chosen if t not in fully_trained_modules]
            # each expert's initial adapter from its own seed: the same whichever experts train (`both`, `high`,
            # `low`, expert parallel), so an expert trains alike in each
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(derive_seed(self.config.seed, 0, 0, f"adapter_init:{name}") >> 1)
                transformer.add_adapter(peft_adapter_config(lora, targets), adapter_name=ADAPTER)
        for name, parameter in self.model.transformer.named_parameters():
            if name in self.full_names:
                parameter.requires_grad_(True)
        if lora.init_from:
            self._init_from_file(Path(lora.init_from))
        for parameter in self.trainable_parameters():
            parameter.data = parameter.data.float()  # adapters train in float32 whatever the base dtype
        self.apply_performance()

    def training_step(self) -> contextlib.AbstractContextManager:
        if self.config.train_dtype.torch_dtype() == torch.float32:
            return super().training_step()
        # Under autocast peft's cast of each adapter's input to the adapter's float32 is a full copy (1.1 GiB for the
        # 1.3B FFN's 8960-wide input at 81x544x736) that autocast narrows again before the matmul: without the
        # cast the numbers are the same and the copy is gone. Only here: sampling runs without autocast.
        stack = contextlib.ExitStack()
        stack.enter_context(super().training_step())
        for expert in self.experts_in_training():
            stack.enter_context(disable_input_dtype_casting(getattr(self.model, expert)))
        return stack

    def _init_from_file(self, path: Path) -> None:
        experts = self.experts_in_training()
        paths = dict(zip(("transformer", "transformer_2"), expert_lora_paths(path))) \
            if self.model.variant.has_two_experts and not path.is_file() else {e: path for e in experts}
        for expert in experts:
            transformer = getattr(self.model, expert)
            if self.model.variant.has_two_experts:
                problem = expert_problem(paths[expert], expert, "lora.init_from")
                if problem:
                    raise ConfigError([f"lora.init_from: {problem}"])
            weights, _layout = load_lora_file(paths[expert])
            weights = match_to_model(weights, {n for n, _ in transformer.named_modules()})
            load_lora_weights_into_peft(transformer, weights, ADAPTER)

    def _trains(self, expert: str, name: str) -> bool:
        return is_adapter_parameter(name) or (expert == "transformer" and name in self.full_names)

    def _named_trainable(self):
        for expert in self.experts_in_training():
            for name, parameter in getattr(self.model, expert).named_parameters():
                if self._trains(expert, name):
                    yield f"{expert}.{name}", parameter

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self._named_trainable()]

    def named_trainable_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(self._named_trainable())

    def trainable_state_dict(self) -> dict[str, Tensor]:
        return {n: p.detach().clone() for n, p in self._named_trainable()}

    def load_trainable_state_dict(self, state: dict[str, Tensor]) -> None:
        for name, parameter in self._named_trainable():
            parameter.data.copy_(state[name])

    def save_result(self, destination: str, output_format: ModelFormat, dtype: torch.dtype | None,
                    train_config: dict | None) -> list[Path]:
        if not output_format.is_lora:
            raise ValueError(f"output.format {output_format} is not a LoRA format (COMFY_LORA, KOHYA_LORA, "
                             f"DIFFUSERS_LORA)")
        check_output_format(self.config.lora.type, output_format)
        destination = Path(destination)
        metadata = modelspec_metadata(self.model.variant, lora=True, train_config=train_config)
        metadata.update(e2v_file_metadata(self.model, self.config.model))  # an E2V LoRA samples from the file alone
        experts = self.experts_in_training()
        if self.model.variant.has_two_experts:
            paths = expert_output_paths(destination, experts)
        else:
            paths = {"transformer": destination}
        written = []
        for expert in experts:
            weights = lora_weights_from_peft(getattr(self.model, expert), ADAPTER)
            if dtype is not None:
                for module in weights.values():
                    module.cast_factors(dtype)
            file_metadata = dict(metadata)
            if self.model.variant.has_two_experts:  # which expert this file is for, and where they hand over
                file_metadata.update(expert_metadata(expert, self.model.boundary_ratio))
            if expert == "transformer" and self.full_names:
                save_e2v_lora(weights, output_format, paths[expert], file_metadata, self.model, dtype)
            else:
                save_lora_file(weights, output_format, paths[expert], file_metadata)
            written.append(paths[expert])
            if (output_format is not ModelFormat.DIFFUSERS_LORA and self.config.lora.type == "LORA"
                    and any(n.startswith("vace_blocks.") for n in weights)):
                # diffusers reads original-name Wan LoRAs only for the base blocks: WanVACEPipeline gets its own file.
                # LoHa / LoKr have no diffusers names at all: their note says to merge instead
                companion = diffusers_companion_path(paths[expert])
                save_lora_file(weights, ModelFormat.DIFFUSERS_LORA, companion, file_metadata)
                written.append(companion)
        return written
