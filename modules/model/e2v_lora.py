"""An E2V LoRA file: the adapter in any LoRA format, plus the full tensors of the parts an expansion added or
widened (`e2v.<diffusers name>`) and the E2V config in the header, so one file restores the whole E2V model on top
of its T2V base."""
import json
from pathlib import Path

import torch
from safetensors import safe_open

from modules.model.e2v_model import E2V_CONFIG_METADATA, E2V_TENSOR_PREFIX, e2v_config_metadata, prepare_e2v_model
from modules.model.WanModel import WanModel
from modules.util.atomic import save_safetensors_atomic
from modules.util.config.E2VConfig import E2VDatasetConfig
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.formats import LoraWeights, lora_to_state_dict
from modules.util.safetensors_only import require_safetensors


def save_e2v_lora(weights: LoraWeights, output_format: ModelFormat, path: str | Path, metadata: dict[str, str],
                  model: WanModel, dtype: torch.dtype | None) -> None:
    tensors = lora_to_state_dict(weights, output_format, dtype)
    state = model.transformer.state_dict()
    for name in model.e2v_trainable:
        # peft leaves unwrapped modules' names as they are; the adapter never wraps the fully trained parts
        value = state[name].detach().cpu()
        tensors[E2V_TENSOR_PREFIX + name] = value.to(dtype) if dtype is not None else value
    metadata = {**metadata, E2V_CONFIG_METADATA: e2v_config_metadata(model.e2v_config)}
    save_safetensors_atomic(tensors, path, metadata)


def read_e2v_lora(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict | None]:
    """(LoRA tensors, expanded-part tensors by diffusers name, E2V config dict or None) of a LoRA file."""
    lora, parts = {}, {}
    require_safetensors(path, "LoRA file")
    with safe_open(str(path), framework="pt") as file:
        metadata = file.metadata() or {}
        for key in file.keys():
            if key.startswith(E2V_TENSOR_PREFIX):
                parts[key.removeprefix(E2V_TENSOR_PREFIX)] = file.get_tensor(key)
            else:
                lora[key] = file.get_tensor(key)
    config = json.loads(metadata[E2V_CONFIG_METADATA]) if E2V_CONFIG_METADATA in metadata else None
    return lora, parts, config


def apply_e2v_parts(model: WanModel, parts: dict[str, torch.Tensor], config: dict) -> None:
    """Expands the model as training did and loads the trained expanded parts (before the adapter is applied)."""
    dataset = E2VDatasetConfig.model_validate({**config, "data_root": "."})
    device = next(model.transformer.parameters()).device
    prepare_e2v_model(model, dataset)
    model.transformer.to(device)  # the expansion builds new parts on the CPU
    state = model.transformer.state_dict()
    unknown = sorted(set(parts) - set(state))
    if unknown:
        raise KeyError(f"the E2V parts {unknown[:4]} do not exist in the expanded transformer")
    with torch.no_grad():
        for name, value in parts.items():
            state[name].copy_(value.to(state[name].dtype))
