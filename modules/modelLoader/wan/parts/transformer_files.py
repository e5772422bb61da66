"""The Wan transformer in the layouts users hold it: a diffusers `transformer/` folder, the official Wan key names
(single file or sharded, as the Wan-AI repositories ship them), and ComfyUI single files (the same names, with or
without a `model.diffusion_model.` / `diffusion_model.` prefix) in fp32 / fp16 / bf16 / fp8_e4m3fn / fp8_scaled.

fp8_scaled: the Linear weights are float8 with a float32 scale beside each (weight = fp8 * scale), in either of
ComfyUI's namings (comfy_quant.py): the legacy `*_fp8_scaled.safetensors` (`scale_weight`, `scale_input`, a
`scaled_fp8` marker) or the mixed-precision format ComfyUI writes today (`weight_scale`, `input_scale`,
`comfy_quant`, or the layer formats in the `_quantization_metadata` header). Input scales are used only by fp8
matrix multiplication, which is not done here. Those layers stay in float8 and are dequantised per call
(`ScaledFp8Linear`); the other weights go through diffusers' layerwise casting as FLOAT_8 does. ComfyUI's nvfp4,
mxfp8 and int8 layer formats are refused, naming a layer.

A file may hold more than the transformer (ComfyUI's `save_checkpoint` adds the VAE under `vae.` and the text
encoder under `text_encoders.`): the transformer is the part under the prefix its `patch_embedding.weight` has.
"""
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from modules.model.transformer_classes import transformer_class
from modules.modelLoader.wan.parts import animate_files
from modules.util.empty_weights import empty_weights
from modules.util.fp8_scaled import ScaledFp8Linear, make_scaled_fp8
from modules.modelLoader.wan.parts import comfy_quant
from modules.modelLoader.wan.parts.state_reads import TensorRead, read_state
from modules.modelLoader.wan.parts.tensor_files import (BUNDLED_MODEL_PREFIXES, DIFFUSION_MODEL_PREFIXES,
                                                        ModelFileError, TensorInfo,
                                                        open_tensors, strip_prefix_keys)
from modules.util.enum.DataType import DataType
from modules.util.lora.keys import _TO_DIFFUSERS, _rename

SCALED_FP8_MARKER = comfy_quant.SCALED_FP8_MARKER
FP8_DTYPES = comfy_quant.FLOAT8_DTYPES


@dataclass(frozen=True)
class TransformerFile:
    layout: str                 # "diffusers", "wan" (official names), "comfyui" (official names, prefixed)
    dtype: str                  # "fp32", "bf16", "fp16", "fp8_e4m3fn", "fp8_scaled"
    names: dict[str, str]       # diffusers name -> key in the file (weights only; scales are in `scales`)
    scales: dict[str, str]      # diffusers Linear module name -> key of its scale_weight / weight_scale
    shapes: dict[str, TensorInfo]   # diffusers name -> shape / dtype
    unreadable: tuple[str, ...] = ()   # quantized layers in a format not read (nvfp4, mxfp8, int8): refused
    takes: dict[str, Callable] = field(default_factory=dict)   # diffusers name -> slice / reshape of the file's
    kernels: dict[str, str] = field(default_factory=dict)      # buffer name -> key: fixed filters, checked at load

    @property
    def is_fp8(self) -> bool:
        return self.dtype.startswith("fp8")


def dtype_label(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8_e4m3fn",
            "float8_e5m2": "fp8_e5m2"}.get(dtype, dtype)


def transformer_prefix(keys) -> str | None:
    """The prefix the transformer's keys carry in this file (`model.diffusion_model.`, `diffusion_model.` or none),
    found by its `patch_embedding.weight` (as ComfyUI's unet_prefix_from_state_dict finds the diffusion model's in
    a checkpoint holding more models), or None when the file has none."""
    for prefix in (*DIFFUSION_MODEL_PREFIXES, ""):
        if f"{prefix}patch_embedding.weight" in keys:
            return prefix
    return None


def recognise_transformer(keys: dict[str, TensorInfo]) -> TransformerFile | None:
    """The layout of a Wan transformer state dict from its key names, or None when it is not one."""
    prefix = transformer_prefix(keys)
    if prefix is None:
        return None
    # name without prefix -> key in the file; with a prefix, keys without it (the VAE / text encoder of a ComfyUI
    # checkpoint that bundles them) are not the transformer's, as ComfyUI reads such files
    stripped = strip_prefix_keys([k for k in keys if k.startswith(prefix)], prefix)
    if not prefix:
        # a bare file: another model's tensors under a prefix (a checkpoint's `vae.`, `text_encoders.`) are not ours
        stripped = {name: key for name, key in stripped.items()
                    if not name.startswith(BUNDLED_MODEL_PREFIXES)}
    if "head.head.weight" in stripped and "blocks.0.self_attn.q.weight" in stripped:
        layout = "comfyui" if prefix else "wan"
    elif "proj_out.weight" in stripped and "blocks.0.attn1.to_q.weight" in stripped:
        layout = "diffusers"
    elif animate_files.is_official_animate_2(stripped):
        layout = "comfyui" if prefix else "wan"
    elif animate_files.is_diffusers_animate_2(stripped):
        layout = "diffusers"
    else:
        return None
    animate_2 = animate_files.is_official_animate_2(stripped) or animate_files.is_diffusers_animate_2(stripped)
    names: dict[str, str] = {}
    scales: dict[str, str] = {}
    for name, key in stripped.items():
        if comfy_quant.is_quant_metadata_key(name):
            continue
        if animate_2:
            name = animate_files.animate_2_name_to_diffusers(name)   # Animate-2's diffusers names are Wan's own
        elif layout != "diffusers":
            # a name the table does not know keeps the name the user sees: the key check reports it as unexpected
            # (an unmatched tensor is never dropped silently)
            name = _rename(name, _TO_DIFFUSERS) or animate_files.animate_name_to_diffusers(name) or name
        if (module := comfy_quant.scale_key_module(name)) is not None:
            scales[module] = key
        elif name.endswith(comfy_quant.BLOCK_SCALE_SUFFIX):
            continue   # nvfp4's second scale: its layer (a uint8 weight) is named in `unreadable` below
        else:
            names[name] = key
    shapes = {name: keys[key] for name, key in names.items()}
    takes, kernels = ({}, {}) if layout == "diffusers" or animate_2 else \
        animate_files.adapt_official_animate(names, shapes, scales)
    unreadable = tuple(problem for module, key in scales.items()
                       if (problem := comfy_quant.layer_problem(module, shapes.get(f"{module}.weight"), keys[key]))
                       is not None)
    matrix = shapes.get("blocks.0.attn1.to_q.weight") or shapes.get("blocks.0.self_attn.to_q.weight")
    dtype = dtype_label(matrix.dtype) if matrix is not None else "unknown"
    if scales or SCALED_FP8_MARKER in stripped:
        dtype = "fp8_scaled"
    return TransformerFile(layout, dtype, names, scales, shapes, unreadable, takes, kernels)


def check_quantization(file: TransformerFile, source: str) -> None:
    """Quantized layers in a format this project does not read, named before any weight is read."""
    if file.unreadable:
        raise ModelFileError(comfy_quant.refusal(source, list(file.unreadable)))


def key_mismatch(model_class, config: dict, shapes: dict[str, TensorInfo]) -> str | None:
    """What keeps `shapes` (diffusers names) from filling a meta-built `model_class(config)`, or None."""
    with empty_weights():
        model = model_class.from_config(config)
    expected = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [f"{n}: {shapes[n].shape} (expected {s})" for n, s in expected.items() if n in shapes
             and shapes[n].shape != s]
    if not (missing or unexpected or wrong):
        return None
    return (f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}), "
            f"{len(wrong)} of the wrong shape (e.g. {wrong[:2]})")


def check_transformer_keys(file: TransformerFile, config: dict, source: str) -> None:
    """Every parameter the config's model has, with its shape, before any weight is read."""
    check_quantization(file, source)
    problem = key_mismatch(transformer_class(config), config, file.shapes)
    if problem:
        raise ModelFileError(f"{source}: the tensors do not make a Wan transformer of this config: {problem}")


def _keeps_fp32(name: str, keep_modules: list[str] | None) -> bool:
    return bool(keep_modules) and any(module in name.split(".") for module in keep_modules)


def fp8_compute_dtype(weight_dtype: DataType) -> torch.dtype:
    """fp8 weights compute in the configured weight dtype's compute type: bfloat16 for FLOAT_8 and BFLOAT_16 (the
    presets), float32 when FLOAT_32 is asked for (CPU runs); the stored fp8 numbers are the same either way."""
    return weight_dtype.torch_dtype()


def _scale_of(scale: torch.Tensor, take, tensors) -> torch.Tensor:
    """A layer's scale; one per output row is sliced as its weight is (a fused official layer split in two)."""
    scale = scale.to(torch.float32)
    return take(scale, tensors) if take is not None and scale.numel() > 1 else scale


def _after(first, then):
    """`first` (the file's tensor sliced / reshaped to the model's), then `then` (cast, dequantise)."""
    if first is None or then is None:
        return first or then
    return lambda tensor, tensors: then(first(tensor, tensors), tensors)


def _cast_to(dtype: torch.dtype):
    return lambda tensor, _tensors: tensor.to(dtype)


def _dequantise_with(scale: torch.Tensor):
    """weight = stored * scale, the scale one per tensor or one per output row (the first dimension)."""
    def take(tensor: torch.Tensor, _tensors) -> torch.Tensor:
        rows = scale.reshape(-1, *([1] * (tensor.dim() - 1))) if scale.numel() > 1 else scale.reshape(())
        return tensor.to(torch.float32) * rows
    return take


def load_transformer(paths: list[Path], file: TransformerFile, config: dict, weight_dtype: DataType,
                     source: str) -> torch.nn.Module:
    """Builds the model on the meta device and assigns the file's tensors one at a time, each cast to its target
    dtype as it is read: the weights exist once in memory. fp8 files stay fp8 (upcasting adds no precision), computed
    in `weight_dtype`'s compute dtype (bfloat16 for FLOAT_8); FLOAT_8 of a wider file is cast to fp8 as it is read,
    never held whole in the wider dtype."""
    check_transformer_keys(file, config, source)
    model_class = transformer_class(config)
    with empty_weights():
        model = model_class.from_config(config)
    keep_fp32 = model_class._keep_in_fp32_modules
    never_fp8 = tuple(model_class._skip_layerwise_casting_patterns or ())
    store_fp8 = file.is_fp8 or weight_dtype is DataType.FLOAT_8
    compute = fp8_compute_dtype(weight_dtype) if store_fp8 else weight_dtype.torch_dtype()
    state: dict[str, torch.Tensor] = {}
    with open_tensors(paths) as tensors:
        scales = {module: _scale_of(tensors[key], file.takes.get(f"{module}.weight"), tensors)
                  for module, key in file.scales.items()}
        # Linear layers keep float8 + scale (ScaledFp8Linear); any other scaled layer (a conv, should a file scale
        # one) is small and dequantised once here, and so are the layers diffusers never stores in float8 (its
        # layerwise-casting skip list: the condition embedders, whose time embedder casts the timestep to its first
        # parameter's dtype, so a float8 weight there would compute the embedding in float8)
        linear = {m for m in scales if isinstance(model.get_submodule(m), torch.nn.Linear)
                  and not any(re.search(pattern, m) for pattern in never_fp8)}
        for module_name in linear:
            make_scaled_fp8(model.get_submodule(module_name), scales[module_name])
            state[f"{module_name}.scale_weight"] = model.get_submodule(module_name).scale_weight
        stored_fp8: set[str] = set()
        if store_fp8:
            # the project's FLOAT_8 path (diffusers' layerwise casting: float8 storage, per-layer upcast), set up on
            # the meta model so its choice of layers says which tensors to cast to fp8 as they are read; the scaled
            # layers dequantise themselves and keep their float32 scales out of these casts
            model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=compute,
                                           skip_modules_classes=(ScaledFp8Linear,))
            stored_fp8 = {n for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
        # each tensor's target dtype, then state_reads (files-enc) fills them with one copy in memory: cast
        # tensors get their storage before any read, so freed read buffers leave no holes among the kept ones
        reads: dict[str, TensorRead] = {}
        for name, key in file.names.items():
            info = file.shapes[name]
            module = name.rsplit(".", 1)[0]
            stored, take = getattr(torch, info.dtype), None
            if module in linear and name.endswith(".weight"):
                # kept as stored (an e5m2 file's range exceeds e4m3fn's); dequantised per call in any float8
                target = stored if info.dtype in FP8_DTYPES else torch.float8_e4m3fn
            elif module in scales and name.endswith(".weight"):
                take = _dequantise_with(scales[module])
                target = torch.float32 if _keeps_fp32(name, keep_fp32) and compute != torch.float32 else compute
            elif not stored.is_floating_point:
                target = stored
            elif name in stored_fp8:
                # through the compute dtype, as the diffusers-folder FLOAT_8 path rounds (load in bf16, then store)
                target = torch.float8_e4m3fn
                take = None if info.dtype == "float8_e4m3fn" else _cast_to(compute)
            elif _keeps_fp32(name, keep_fp32) and compute != torch.float32:
                target = torch.float32
            else:
                target = compute
            reads[name] = TensorRead(key, info.shape, target, info.dtype, _after(file.takes.get(name), take))
        state.update(read_state(tensors, reads))
        if file.kernels:
            animate_files.check_blur_kernels(model, file.kernels, tensors, source)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()
