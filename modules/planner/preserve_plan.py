"""`distill.mode` "preserve" in the planner: the frozen accelerator a step trains beside, built at its real shapes,
so the traced step holds its factors (weights), runs its hooks (forward and the checkpointed recompute) and the
teacher's second forward pass without a gradient (modules/modelSetup/distill_preserve.py), as the run does.

The accelerator's rank is read from its file's header when the file is there; otherwise (a preset whose files the
user fills) it is planned at ASSUMED_RANK on every attention and FFN layer of the blocks, the layout of the
Wan2.2-Lightning and lightx2v 4-step LoRAs.
"""
from __future__ import annotations

from pathlib import Path

import torch

from modules.benchmark.architectures import TEXT_SEQUENCE_LENGTH

ASSUMED_RANK = 64   # Wan2.2-Lightning's "4steps-lora-rank64" files; lightx2v's distill LoRAs come in 32 to 128 too
_DOWN_KEYS = (".lora_down.weight", ".lora_A.weight")


def accelerator_rank(path: str) -> tuple[int, bool]:
    """(the largest rank of the file's low-rank modules, whether it was read); (ASSUMED_RANK, False) when the file
    is not there or holds none. Reads the header only."""
    if not path or not Path(path).is_file():
        return ASSUMED_RANK, False
    from safetensors import safe_open
    with safe_open(str(path), framework="pt", device="cpu") as handle:
        ranks = [handle.get_slice(key).get_shape()[0] for key in handle.keys() if key.endswith(_DOWN_KEYS)]
    return (max(ranks), True) if ranks else (ASSUMED_RANK, False)


def planned_preserve(config, model, experts: list[str], device: torch.device):
    """The run's PreserveTraining with an accelerator of the file's rank on every block attention / FFN Linear of
    the trained experts, its factors made on `device` in the dtype the hooks compute in (under the planner's fake
    mode: shapes only)."""
    from modules.modelSampler.accelerator import Accelerator
    from modules.modelSetup.distill_preserve import PreserveTraining
    from modules.util.lora.accelerator_files import AcceleratorFile
    from modules.util.lora.apply import _base_layer
    from modules.util.lora.LoraModule import LoraModule
    accelerator = config.sampling.accelerator
    distill = config.distill
    # the empty caption's embeddings: shaped as the step's own (1, L, D)
    empty_text = torch.zeros(1, TEXT_SEQUENCE_LENGTH, getattr(model, experts[0]).config.text_dim, device=device) \
        if distill.preserve_on == "empty_caption" and distill.preserve_weight else None
    if not accelerator.enabled:   # a distilled release (Animate-2's): the teacher pass only
        return PreserveTraining(None, distill.preserve_weight, empty_text)
    files = {}
    for expert in experts:
        path = accelerator.file_2 if expert == "transformer_2" and accelerator.file_2 else accelerator.file
        rank, _ = accelerator_rank(path)
        lora = {}
        for name, module in getattr(model, expert).named_modules():
            # peft's wrapper stands for its base layer (its own lora_A / lora_B / base_layer Linears are not)
            if not (name.startswith("blocks.") and (".attn" in name or ".ffn" in name)) \
                    or name.endswith(".base_layer") or ".lora_" in name:
                continue
            base = _base_layer(module)
            if not isinstance(base, torch.nn.Linear):
                continue
            dtype = base.weight.dtype if base.weight.element_size() > 1 else torch.bfloat16
            lora[name] = LoraModule(down=torch.zeros(rank, base.in_features, dtype=dtype, device=device),
                                    up=torch.zeros(base.out_features, rank, dtype=dtype, device=device),
                                    alpha=float(rank))
        files[expert] = AcceleratorFile(Path(path or "accelerator.safetensors"), lora)
    return PreserveTraining(Accelerator(accelerator, files), distill.preserve_weight, empty_text)


def describe(config) -> str:
    """The plan's line for the mode."""
    distill = config.distill
    on = "on the empty caption" if distill.preserve_on == "empty_caption" else "on the step's caption"
    teacher = f"teacher pass {on} (weight {distill.preserve_weight:g})" if distill.preserve_weight else ""
    if not config.sampling.accelerator.enabled:
        return f"distill preserve: on the distilled release, {teacher or 'no teacher pass'}"
    rank, read = accelerator_rank(config.sampling.accelerator.file)
    return f"distill preserve: accelerator rank {rank}{'' if read else ' (assumed)'} attached" + \
        (f", {teacher}" if teacher else "")
