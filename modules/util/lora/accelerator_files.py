"""Accelerator files (step/CFG-distill LoRAs: lightx2v, Wan2.2-Lightning, CausVid): read with the project's LoRA
reader (every layout of modules/util/lora/formats.py) plus the full-weight deltas `.diff` / `.diff_b` that ComfyUI
and LightX2V add to a weight / bias, and checked before any model loads (missing, not a LoRA, not a Wan LoRA)."""
from dataclasses import dataclass, field
from pathlib import Path

from torch import Tensor

from modules.util.config.AcceleratorConfig import AcceleratorConfig

# module names of the Wan transformer in diffusers naming that a Wan LoRA touches (the family check)
_WAN_BLOCK_PARTS = ("attn1", "attn2", "ffn", "norm2", "scale_shift_table")


class AcceleratorError(ValueError):
    """An accelerator that cannot be used as configured (missing file, not a LoRA, not a Wan LoRA)."""


@dataclass
class AcceleratorFile:
    path: Path
    lora: dict = field(default_factory=dict)     # LoraWeights: diffusers module name -> LoraModule
    deltas: dict[str, Tensor] = field(default_factory=dict)   # diffusers parameter name -> full-weight delta
    layout: str = ""


def _read_state_dict(path: Path) -> dict[str, Tensor]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def read_accelerator_file(path: str | Path, module_names=None) -> AcceleratorFile:
    """The file's low-rank modules and full-weight deltas, keyed by diffusers names. AcceleratorError when it holds
    neither, or nothing of a Wan transformer."""
    from modules.util.lora.formats import LoraMatchError, lora_from_state_dict, split_full_deltas
    path = Path(path)
    rest, deltas = split_full_deltas(_read_state_dict(path), module_names)
    lora, layout = {}, ""
    if rest:
        try:
            lora, layout = lora_from_state_dict(rest, module_names)
        except LoraMatchError:
            if not deltas:
                raise AcceleratorError(f"{path}: not a LoRA (no lora_down/up, lora_A/B, .diff or .diff_b keys; "
                                       f"keys, e.g.: {list(rest)[:3]})") from None
    if not lora and not deltas:
        raise AcceleratorError(f"{path}: not a LoRA (the file holds no tensors of one)")
    names = list(lora) + [name.rsplit(".", 1)[0] for name in deltas]
    if not any(name.startswith("blocks.") and name.split(".")[2:3] and name.split(".")[2] in _WAN_BLOCK_PARTS
               for name in names):
        raise AcceleratorError(f"{path}: not a Wan LoRA (none of its modules is a Wan transformer block's; e.g. "
                               f"{names[:3]})")
    return AcceleratorFile(path, lora, deltas, layout + ("+diff" if deltas else ""))


def accelerator_problems(config: AcceleratorConfig, field_name: str = "sampling.accelerator") -> list[str]:
    """Every problem of the configured files (missing, not safetensors, not a LoRA, not a Wan LoRA), each naming the
    field; [] for a usable or disabled accelerator. Reads the files, loads no model."""
    from modules.util.safetensors_only import require_safetensors
    if not config.file:
        return [f"{field_name}.file_2: set without {field_name}.file"] if config.file_2 else []
    problems = []
    for name in ("file", "file_2"):
        path = getattr(config, name)
        if not path:
            continue
        label = f"{field_name}.{name} {path}"
        if not Path(path).is_file():
            problems.append(f"{label}: does not exist (or is not a file)")
            continue
        try:
            require_safetensors(path, "accelerator LoRA")
            read_accelerator_file(path)
        except (AcceleratorError, ValueError, OSError) as error:
            problems.append(f"{label}: {error}")
    return problems
