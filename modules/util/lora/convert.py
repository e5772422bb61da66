"""LoRA files between formats (scripts/convert_model.py; merging into a base model is the sampler's
`apply_lora_files`).

Converting (`convert_lora_files`): any layout `load_lora_file` reads -> COMFY_LORA, KOHYA_LORA or DIFFUSERS_LORA
(`formats.save_lora_file`), the input's safetensors metadata (modelspec, training config) kept. Wan 2.2 A14B
pairs (`expert_lora_pairs`): an input named `x_high_noise.safetensors` or `x_low_noise.safetensors`, or `x.safetensors`
that does not exist while `x_high_noise` / `x_low_noise` do, converts every existing file of the pair into the output's
`_high_noise` / `_low_noise` names.
"""
import logging
import os
from pathlib import Path

import torch

from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.formats import LoraMatchError, LoraWeights, load_lora_file, save_lora_file
from modules.util.lora.keys import diffusers_module_to_original

logger = logging.getLogger(__name__)

EXPERT_SUFFIXES = ("_high_noise", "_low_noise")  # transformer, transformer_2

# Header keys not carried into a converted file: diffusers' `lora_adapter_metadata` is a peft LoraConfig that
# diffusers' `load_lora_weights` would use instead of the alphas the converted file now states explicitly (COMFY /
# KOHYA `.alpha` keys, or alpha / rank folded into lora_B for DIFFUSERS_LORA).
_DROPPED_METADATA = ("lora_adapter_metadata",)


class LoraConvertError(ValueError):
    """A LoRA conversion or merge that cannot be done as asked (missing file, not a LoRA format, ...)."""


def _split_expert(path: Path) -> tuple[Path, str | None]:
    """`x_high_noise.safetensors` -> (`x.safetensors`, "_high_noise"); other names -> (path, None)."""
    stem = path.name.removesuffix(".safetensors")
    for suffix in EXPERT_SUFFIXES:
        if stem.endswith(suffix):
            return path.with_name(stem.removesuffix(suffix) + ".safetensors"), suffix
    return path, None


def _with_suffix(base: Path, suffix: str) -> Path:
    return base.with_name(base.name.removesuffix(".safetensors") + suffix + ".safetensors")


def expert_lora_pairs(input_path: str | os.PathLike, output_path: str | os.PathLike) -> list[tuple[Path, Path]]:
    """(input file, output file) pairs to convert; see the module docstring for the A14B naming rules."""
    input_path, output_path = Path(input_path), Path(output_path)
    input_base, input_suffix = _split_expert(input_path)
    if input_suffix is None and input_path.is_file():
        return [(input_path, output_path)]
    output_base, _ = _split_expert(output_path)
    pairs = [(_with_suffix(input_base, s), _with_suffix(output_base, s)) for s in EXPERT_SUFFIXES]
    pairs = [(source, target) for source, target in pairs if source.is_file()]
    if not pairs:
        names = " / ".join(_with_suffix(input_base, s).name for s in EXPERT_SUFFIXES)
        raise LoraConvertError(f"LoRA file {str(input_path)!r} does not exist, nor its expert pair {names}")
    if input_suffix is None or len(pairs) == 1:
        missing = [_with_suffix(input_base, s).name for s in EXPERT_SUFFIXES
                   if not _with_suffix(input_base, s).is_file()]
        if missing:
            logger.warning("LoRA %s: no %s beside it; converting only %s", input_path, missing[0], pairs[0][0].name)
    return pairs


def _read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    from modules.util.safetensors_only import require_safetensors
    require_safetensors(path, "LoRA file")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        return dict(f.metadata() or {})


def _transformer_modules(weights: LoraWeights, path: Path) -> LoraWeights:
    """The modules that name a Wan transformer module (text-encoder parts of kohya files and the like are dropped,
    with a warning); none raises LoraMatchError."""
    known, unknown = {}, []
    for name, module in weights.items():
        try:
            diffusers_module_to_original(name)
        except KeyError:
            unknown.append(name)
        else:
            known[name] = module
    if not known:
        raise LoraMatchError(f"{path}: none of the {len(weights)} LoRA modules name a Wan transformer module "
                             f"(e.g. {sorted(unknown)[:5]})")
    if unknown:
        logger.warning("%s: %d of %d LoRA modules name no Wan transformer module and are dropped (e.g. %s)",
                       path, len(unknown), len(weights), sorted(unknown)[:5])
    return known


def convert_lora_file(input_path: str | os.PathLike, output_path: str | os.PathLike, fmt: ModelFormat,
                      dtype: torch.dtype | None = None) -> str:
    """One file to `fmt`, metadata kept (less `_DROPPED_METADATA`); returns the input's layout name."""
    fmt = ModelFormat(fmt)
    if not fmt.is_lora:
        raise LoraConvertError(f"{fmt} is not a LoRA format (COMFY_LORA, KOHYA_LORA, DIFFUSERS_LORA)")
    input_path = Path(input_path)
    weights, layout = load_lora_file(input_path)
    weights = _transformer_modules(weights, input_path)
    metadata = {k: v for k, v in _read_metadata(input_path).items() if k not in _DROPPED_METADATA}
    save_lora_file(weights, fmt, output_path, metadata, dtype)
    return layout


def convert_lora_files(input_path: str | os.PathLike, output_path: str | os.PathLike, fmt: ModelFormat,
                       dtype: torch.dtype | None = None) -> list[tuple[Path, Path, str]]:
    """`input_path` (or its A14B pair) to `fmt`; returns (input, output, input layout) per file written."""
    done = []
    for source, target in expert_lora_pairs(input_path, output_path):
        layout = convert_lora_file(source, target, fmt, dtype)
        done.append((source, target, layout))
    return done
