"""Checks of the memory and speed settings that must hold before any model loads (ConfigError, exit 2)."""
import json

import torch

from modules.util.config.TrainConfig import TrainConfig

_TRANSFORMERS = ("transformer", "transformer_2")
_GPU_ATTENTION = ("cudnn", "efficient")


def performance_problems(config: TrainConfig, device: torch.device) -> list[str]:
    """Every problem, one line each, naming the field and what is allowed."""
    problems = []
    performance = config.performance
    for part in ("transformer", "transformer_2", "vae", "text_encoder", "image_encoder"):
        dtype = getattr(config.model, part).weight_dtype
        if not dtype.is_quantized:
            continue
        if part not in _TRANSFORMERS:
            problems.append(f"model.{part}.weight_dtype: {dtype} (bitsandbytes) is for transformer weights only; "
                            f"use BFLOAT_16 or FLOAT_32")
        elif device.type != "cuda":
            problems.append(f"model.{part}.weight_dtype: {dtype} weights run through bitsandbytes on a CUDA GPU "
                            f"only, and the device is {device.type}; use FLOAT_8 or BFLOAT_16 (or a CUDA device)")
        elif performance.block_swap:
            problems.append(f"model.{part}.weight_dtype: {dtype} weights cannot be swapped to the CPU "
                            f"(performance.block_swap {performance.block_swap}); use FLOAT_8 with block swap")
        elif config.training_method.value == "FINE_TUNE":
            problems.append(f"model.{part}.weight_dtype: {dtype} weights are frozen; a fine-tune trains them: use "
                            f"FLOAT_32 or BFLOAT_16")
    if config.output.dtype.is_quantized:
        problems.append(f"output.dtype: {config.output.dtype} is a storage format for base weights; use "
                        f"BFLOAT_16, FLOAT_16 or FLOAT_32")
    if performance.activation_offload and not config.gradient_checkpointing:
        problems.append("performance.activation_offload: offloads the inputs of checkpointed blocks, but "
                        "gradient_checkpointing is false; turn it on")
    if performance.attention in _GPU_ATTENTION and device.type == "cpu":
        problems.append(f"performance.attention: {performance.attention!r} is a GPU kernel and the device is cpu; "
                        f"use auto, flash or math")
    layers = _num_layers(config)
    if layers is not None and performance.block_swap >= layers:
        problems.append(f"performance.block_swap: {performance.block_swap} swaps every one of the model's {layers} "
                        f"blocks; at most {layers - 1}")
    return problems


def _num_layers(config: TrainConfig) -> int | None:
    from modules.util.config.validation import transformer_config_path  # the part override counts too
    path = transformer_config_path(config, "transformer")
    if path is None:
        return None
    try:
        return int(json.loads(path.read_text(encoding="utf-8"))["num_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
