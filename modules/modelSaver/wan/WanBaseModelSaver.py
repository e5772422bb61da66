"""Saves the base weights: a diffusers folder, or an original-format single-file transformer. Writes are atomic,
and casting to the output dtype works on copies: the live model is never touched."""
import json
from pathlib import Path

import torch

from modules.model.WanModel import WanModel
from modules.util.portable_folder import make_portable
from modules.util.atomic import atomic_dir, save_safetensors_atomic
from modules.util.safetensors_stream import Deferred, materialise, write_safetensors
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.WanVariant import WanVariant
from modules.util.expert_metadata import expert_metadata
from modules.util.modelspec import modelspec_metadata
from modules.util.lora.keys import diffusers_to_original_state_dict
from modules.modelLoader.wan.parts.animate_files import diffusers_to_official


FLOAT8 = torch.float8_e4m3fn


def _cast_tensor(name: str, value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    value = value.detach().cpu()
    if dtype is None or not value.is_floating_point():
        return value
    if dtype == FLOAT8:
        # as the fp8 Wan files ComfyUI loads: the weight matrices in float8_e4m3fn, biases, norms, modulation
        # tables and embeddings' small vectors in bfloat16 (fp8 would cost them most of their precision)
        is_matrix = name.endswith(".weight") and value.dim() >= 2
        return value.to(FLOAT8 if is_matrix else torch.bfloat16)
    return value.to(dtype)


def cast_in_place(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Each parameter and buffer cast as `_cast_tensor` casts it for a save, one tensor at a time (each old tensor is
    freed as its cast replaces it): for a model that is only saved, the save then copies nothing. fp8_scaled layers
    are left to the save, which dequantises them."""
    from modules.util.fp8_scaled import ScaledFp8Linear
    for name, layer in module.named_modules():
        if isinstance(layer, ScaledFp8Linear):
            continue
        prefix = f"{name}." if name else ""
        for key, tensor in list(layer.named_parameters(recurse=False)) + list(layer.named_buffers(recurse=False)):
            tensor.data = _cast_tensor(prefix + key, tensor.data, dtype)


def _cast_dtype(name: str, value: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `_cast_tensor` gives `value`."""
    if dtype is None or not value.is_floating_point():
        return value.dtype
    if dtype == FLOAT8:
        return FLOAT8 if name.endswith(".weight") and value.dim() >= 2 else torch.bfloat16
    return dtype


def _deferred_cast(name: str, value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor | Deferred:
    """`value` cast as `_cast_tensor` casts it, made only when the file writes it (a host tensor kept as it is
    needs no copy at all)."""
    target = _cast_dtype(name, value, dtype)
    if target == value.dtype and value.device.type == "cpu":
        return value.detach()
    return Deferred(target, tuple(value.shape), lambda: _cast_tensor(name, value, dtype))


def _cast_state_dict(module: torch.nn.Module, dtype: torch.dtype | None,
                     computable: bool = False) -> dict[str, torch.Tensor | Deferred]:
    """The weights as plain tensors, each made as the file writes it (`Deferred`), so a save never holds the whole
    converted model: layers loaded from an fp8_scaled file are dequantised (weight * scale) in float32 first; with
    `computable` (a diffusers folder) float8 weights kept as stored go to bfloat16 when no dtype is asked for, as no
    diffusers layer computes in float8."""
    from modules.util.fp8_scaled import ScaledFp8Linear
    state: dict[str, torch.Tensor | Deferred] = dict(module.state_dict(keep_vars=False))
    for name, layer in module.named_modules():
        if isinstance(layer, ScaledFp8Linear):
            prefix = f"{name}." if name else ""
            state.pop(prefix + "scale_weight", None)
            key = prefix + "weight"
            target = _cast_dtype(key, torch.empty(0, 0), dtype) if dtype is not None else torch.float32
            state[key] = Deferred(target, tuple(layer.weight.shape), lambda key=key, layer=layer: _cast_tensor(
                key, layer.dequantised_weight(torch.float32), dtype))
    out = {}
    for key, value in state.items():
        if isinstance(value, Deferred):
            out[key] = value
            continue
        if dtype is None and computable and value.dtype in (FLOAT8, torch.float8_e5m2):
            out[key] = Deferred(torch.bfloat16, tuple(value.shape), lambda value=value: value.to(torch.bfloat16))
            continue
        out[key] = _deferred_cast(key, value, dtype)
    return out


def _scaled_fp8_state_dict(original: dict[str, torch.Tensor | Deferred]) -> dict[str, torch.Tensor | Deferred]:
    """ComfyUI's `*_fp8_scaled` layout (comfy/ops.py scaled_fp8_ops): each Linear weight of the blocks as float8 with
    a float32 `scale_weight` (its absmax / 448), the other tensors in bfloat16, and the `scaled_fp8` marker. Each
    weight is quantised as it is written (its scale is worked out again for its own entry: one pass over one
    tensor, instead of every quantised weight held until the file is written)."""
    from modules.util.fp8_scaled import quantise_scaled_fp8
    out: dict[str, torch.Tensor | Deferred] = {}
    for key, value in original.items():
        shape = tuple(value.shape)
        if key.startswith("blocks.") and key.endswith(".weight") and len(shape) == 2:
            out[key] = Deferred(FLOAT8, shape, lambda value=value: quantise_scaled_fp8(materialise(value))[0])
            out[key.removesuffix(".weight") + ".scale_weight"] = Deferred(
                torch.float32, (), lambda value=value: quantise_scaled_fp8(materialise(value))[1])
        elif value.dtype.is_floating_point and value.dtype != torch.bfloat16:
            out[key] = Deferred(torch.bfloat16, shape, lambda value=value: materialise(value).to(torch.bfloat16))
        else:
            out[key] = value
    out["scaled_fp8"] = torch.empty(0, dtype=FLOAT8)
    return out


def expert_file_path(destination: Path, expert: str, model: WanModel) -> Path:
    """Two-expert models write `<name>_high_noise.safetensors` and `<name>_low_noise.safetensors`."""
    if model.transformer is None or model.transformer_2 is None:
        return destination
    suffix = "_high_noise" if expert == "transformer" else "_low_noise"
    return destination.with_name(destination.stem + suffix + destination.suffix)


class WanBaseModelSaver:
    def save(self, model: WanModel, output_format: ModelFormat, destination: str | Path,
             dtype: torch.dtype | None = None, train_config: dict | None = None) -> list[Path]:
        destination = Path(destination)
        if output_format is ModelFormat.DIFFUSERS:
            self._save_diffusers(model, destination, dtype)
            return [destination]
        if output_format is ModelFormat.ORIGINAL:
            return self._save_original(model, destination, dtype, train_config)
        if output_format is ModelFormat.ORIGINAL_FP8_SCALED:
            return self._save_original(model, destination, torch.float32, train_config, scaled_fp8=True)
        raise ValueError(f"output format {output_format} is not a base-model format; use DIFFUSERS, ORIGINAL or "
                         f"ORIGINAL_FP8_SCALED")

    @staticmethod
    def _save_diffusers(model: WanModel, destination: Path, dtype: torch.dtype | None) -> None:
        if dtype == FLOAT8:
            raise ValueError("a diffusers folder is not written in FLOAT_8: diffusers' from_pretrained would compute "
                             "in float8, which its layers cannot; write ORIGINAL (a single file ComfyUI loads in "
                             "fp8) or a diffusers folder in BFLOAT_16")
        with atomic_dir(destination) as tmp:
            # model_index.json exactly as diffusers writes it for this pipeline class
            model.create_pipeline().save_config(tmp)
            model.tokenizer.save_pretrained(tmp / "tokenizer")
            model.noise_scheduler.save_pretrained(tmp / "scheduler")
            if model.image_processor is not None:
                model.image_processor.save_pretrained(tmp / "image_processor")
            for name, part in model.parts().items():
                state = _cast_state_dict(part, dtype, computable=True)
                if hasattr(part, "save_config"):  # diffusers models
                    part.save_config(tmp / name)
                    write_safetensors(state, tmp / name / "diffusion_pytorch_model.safetensors")
                else:  # transformers models: their save_pretrained takes whole tensors
                    part.save_pretrained(tmp / name, state_dict={k: materialise(v) for k, v in state.items()},
                                         safe_serialization=True)
            if dtype is not None:
                # transformers configs record their dtype; keep them truthful
                for name in ("text_encoder", "image_encoder"):
                    config_path = tmp / name / "config.json"
                    if config_path.is_file():
                        config = json.loads(config_path.read_text())
                        config["dtype"] = str(dtype).removeprefix("torch.")
                        config_path.write_text(json.dumps(config, indent=2))
            make_portable(tmp)

    @staticmethod
    def _save_original(model: WanModel, destination: Path, dtype: torch.dtype | None,
                       train_config: dict | None, scaled_fp8: bool = False) -> list[Path]:
        written = []
        for expert in ("transformer", "transformer_2"):
            transformer = getattr(model, expert)
            if transformer is None:
                continue
            path = expert_file_path(destination, expert, model)
            state = _cast_state_dict(transformer, dtype)
            # Animate's motion / face encoders and face adapter have names (and a stacked key-value layout) of their
            # own in the official files: animate_files writes them as the official code and ComfyUI read them
            if model.variant.is_animate:
                # the official layout stacks and reshapes some encoder and adapter tensors: those are made now
                state = diffusers_to_official({k: v if k.startswith("blocks.") else materialise(v)
                                               for k, v in state.items()}, model.variant is WanVariant.ANIMATE_2_14B)
            else:
                state = diffusers_to_original_state_dict(state)
            if scaled_fp8:
                state = _scaled_fp8_state_dict(state)
            metadata = modelspec_metadata(model.variant, train_config=train_config)
            metadata["config"] = json.dumps(dict(transformer.config))
            if model.variant.has_two_experts:
                metadata.update(expert_metadata(expert, model.boundary_ratio))
            save_safetensors_atomic(state, path, metadata)
            written.append(path)
        return written
