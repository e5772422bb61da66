"""Expanding a text-to-video Wan transformer for E2V (DESIGN.md 6.10).

The expanded model takes cat(noisy latents, condition) (16 + 20 or 16 + 16 input channels) and, given `image_dim`,
has the I2V image branch (`condition_embedder.image_embedder`, `attn2.add_k_proj`, `attn2.add_v_proj`,
`attn2.norm_added_k`). The new input channels of `patch_embedding` are zero and `add_v_proj` is zero (weight and
bias), so the image attention adds exactly 0 and the expanded model's output equals the base model's at step 0
(text padded to 512 tokens, as every model with an image branch needs). The result is an I2V-architecture
transformer: saved as a diffusers folder, `WanImageToVideoPipeline` loads it.
"""
from __future__ import annotations

import re

import torch
from diffusers import WanTransformer3DModel

from modules.util.empty_weights import empty_weights
from modules.util.fp8_scaled import ScaledFp8Linear, make_scaled_fp8

# The parameters that expansion creates or changes: they train fully (also under LoRA) and are saved with the adapter.
_EXPANDED = re.compile(r"(^|\.)(patch_embedding|condition_embedder\.image_embedder|add_k_proj|add_v_proj|"
                       r"norm_added_k)\.")
# peft's own parameters inside a wrapped module (a LoRA on add_k_proj, say) are adapter weights, not these.
_ADAPTER = re.compile(r"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector|hada_\w+|lokr_\w+)\.")


_NEW_MODULES = ("image_embedder", "add_k_proj", "add_v_proj", "norm_added_k")


def _image_branch_modules(transformer: WanTransformer3DModel) -> dict[str, torch.nn.Module]:
    modules = {"condition_embedder.image_embedder": transformer.condition_embedder.image_embedder}
    for index, block in enumerate(transformer.blocks):
        for name in ("add_k_proj", "add_v_proj", "norm_added_k"):
            modules[f"blocks.{index}.attn2.{name}"] = getattr(block.attn2, name)
    return modules


def expand_t2v_for_e2v(transformer: WanTransformer3DModel, condition_channels: int = 20,
                       image_dim: int | None = None) -> WanTransformer3DModel:
    """A new transformer with `in_channels = base in_channels + condition_channels` and, when `image_dim` is given
    (the CLIP hidden size: 1280 for ViT-H/14), an image branch with `added_kv_proj_dim` = the inner dim.

    Built from the widened config without allocating weights, then given the base's tensors (no copy: the base
    transformer shares them and should be discarded) and a `patch_embedding` whose new input-channel weights are 0.
    The image branch starts with the modules' own initialisation (Linear: Kaiming-uniform; norms: 1 / 0), except
    `add_v_proj`, which is 0. Expects no peft adapters; float8 storage (layerwise casting, fp8_scaled layers) carries over."""
    config = transformer.config
    if hasattr(transformer, "peft_config"):
        raise ValueError("expand the transformer before adding adapters to it")
    if config.in_channels != config.out_channels:
        raise ValueError(f"the transformer already takes a condition (in_channels {config.in_channels}, out_channels "
                         f"{config.out_channels}); only a text-to-video transformer is expanded")
    if config.image_dim is not None or config.added_kv_proj_dim is not None:
        raise ValueError("the transformer already has an image branch")
    if condition_channels < 1:
        raise ValueError(f"condition_channels must be positive, got {condition_channels}")
    if image_dim is not None and image_dim < 1:
        raise ValueError(f"image_dim must be positive, got {image_dim}")

    inner_dim = config.num_attention_heads * config.attention_head_dim
    new_config = {key: value for key, value in dict(config).items() if not key.startswith("_")}
    new_config["in_channels"] = config.in_channels + condition_channels
    if image_dim is not None:
        new_config.update(image_dim=image_dim, added_kv_proj_dim=inner_dim)
    with empty_weights():
        expanded = WanTransformer3DModel.from_config(new_config)
    for name, module in transformer.named_modules():
        if isinstance(module, ScaledFp8Linear):   # a base read from a ComfyUI fp8_scaled file keeps its scales
            make_scaled_fp8(expanded.get_submodule(name), module.scale_weight)

    state = transformer.state_dict()
    weight = state["patch_embedding.weight"]
    zeros = weight.new_zeros(weight.shape[0], condition_channels, *weight.shape[2:])
    state["patch_embedding.weight"] = torch.cat([weight, zeros], dim=1)
    result = expanded.load_state_dict(state, strict=False, assign=True)

    new_modules = _image_branch_modules(expanded) if image_dim is not None else {}
    expected_missing = {f"{prefix}.{name}" for prefix, module in new_modules.items()
                        for name, _ in module.named_parameters()}
    if set(result.missing_keys) != expected_missing or result.unexpected_keys:
        raise RuntimeError(f"expanding the transformer: missing {sorted(set(result.missing_keys) - expected_missing)}"
                           f", not missing {sorted(expected_missing - set(result.missing_keys))}, unexpected "
                           f"{sorted(result.unexpected_keys)}")

    device, dtype = weight.device, weight.dtype
    keep_fp32 = WanTransformer3DModel._keep_in_fp32_modules or []
    for prefix, module in new_modules.items():
        module.to_empty(device=device)
        for submodule in module.modules():
            if hasattr(submodule, "reset_parameters"):
                submodule.reset_parameters()
        for name, parameter in module.named_parameters():
            full_name = f"{prefix}.{name}".split(".")
            target = torch.float32 if any(part in keep_fp32 for part in full_name) else dtype
            parameter.data = parameter.data.to(target)
        if prefix.endswith("add_v_proj"):
            torch.nn.init.zeros_(module.weight)
            torch.nn.init.zeros_(module.bias)

    leftover = [name for name, parameter in expanded.named_parameters() if parameter.is_meta]
    if leftover:
        raise RuntimeError(f"expanding the transformer left parameters without values: {leftover}")
    requires_grad = transformer.patch_embedding.weight.requires_grad
    base_flags = dict(transformer.named_parameters())
    for name, parameter in expanded.named_parameters():
        parameter.requires_grad_(base_flags[name].requires_grad if name in base_flags and
                                 name != "patch_embedding.weight" else requires_grad)
    if getattr(transformer, "gradient_checkpointing", False):
        expanded.enable_gradient_checkpointing()
    if any(p.dtype == torch.float8_e4m3fn for p in transformer.parameters()):
        # float8 base weights (FLOAT_8, fp8 files): the same per-layer upcast, never on the new (trained) modules
        from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN
        expanded.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=dtype,
                                          skip_modules_pattern=tuple(DEFAULT_SKIP_MODULES_PATTERN) + _NEW_MODULES,
                                          skip_modules_classes=(ScaledFp8Linear,))
    return expanded.train(transformer.training)


def expanded_parameter_names(transformer: torch.nn.Module) -> list[str]:
    """The parameters that E2V expansion creates or widens (patch_embedding.*, condition_embedder.image_embedder.*,
    *.add_k_proj.*, *.add_v_proj.*, *.norm_added_k.*), as `transformer.named_parameters()` names them (also inside a
    peft wrapper; peft's own adapter weights are not included). They train fully and are saved with the adapter."""
    return [name for name, _ in transformer.named_parameters()
            if _EXPANDED.search(name) and not _ADAPTER.search(name)]
