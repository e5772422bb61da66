"""Expert-parallel Wan 2.2 A14B (`expert: both` on an even number of processes, docs/multi-gpu.md): the high-noise
expert lives on the first half of the ranks, the low-noise expert on the second half, each half data parallel (DDP
over its own group), and every step trains both experts at once.

What it equals. Each half is the single-expert run of its expert: every micro-step of a high-noise rank draws its
sigmas in [boundary, 1] (a low-noise rank in [0, boundary)) from the step's generator, on the batches, noise and
learning-rate schedule of one process with `expert: high` (`low`) and the same seed; the two halves take the same
batches (one data order), and the experts share nothing trainable (their own adapters, their own optimizer state).
So the `_high_noise` file of an expert-parallel run of S steps is the file of an `expert: high` run of S steps, and
the `_low_noise` file that of `expert: low`: a 2-process step does the work of one high-noise step and one low-noise
step, in the time of one (the halves meet only for the step's loss, gradient norm and stop check). This is not the
single-process `both` run, which routes each step to one expert (by a sigma from the whole schedule): there each
expert gets its share of the steps, here each gets every step.

The trained tensors (adapters and their optimizer state) of an expert are current on its own ranks; backups, saves and
previews first bring the other expert's from its first rank (`gather`); the validation loss splits its sigmas by
expert.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.TrainingMethod import TrainingMethod

EXPERTS = ("transformer", "transformer_2")


def applies(config: TrainConfig, world: int) -> bool:
    """Whether a run of `world` processes is expert parallel (read from the model's configs, before it loads)."""
    if world < 2 or world % 2 or not config.distributed.expert_parallel or config.expert != "both" \
            or config.training_method is not TrainingMethod.LORA:
        return False
    from modules.planner.plan_shapes import PlanError, resolve_architecture
    try:
        return resolve_architecture(config).variant.has_two_experts
    except PlanError:
        return False


def problems(config: TrainConfig, world: int) -> list[str]:
    if not applies(config, world):
        return []
    what = f"with expert-parallel A14B training (expert: both on {world} processes; distributed.expert_parallel)"
    from pathlib import Path

    from modules.planner.plan_shapes import resolve_architecture
    from modules.trainer.prepare import expert_problems
    found = []
    variant, base = resolve_architecture(config).variant, Path(config.model.base_model_name)
    for side in ("high", "low"):   # each half draws every step's sigmas in its own expert's range
        found += [f"{problem} {what}, or set distributed.expert_parallel false"
                  for problem in expert_problems(config.model_copy(update={"expert": side}), variant, base)]
    if config.optimizer.ema:
        found.append(f"optimizer.ema: not supported yet {what}")
    if config.distributed.context_parallel > 1 or config.distributed.shard_base is True \
            or config.distributed.cpu_offload:
        found.append(f"distributed.context_parallel / shard_base / cpu_offload: not combined yet {what}")
    return found


class ExpertGroups:
    """This rank's expert and its group; every rank builds it (dist.new_group is collective)."""

    def __init__(self, rank: int, world: int):
        half = world // 2
        self.owner = {EXPERTS[0]: 0, EXPERTS[1]: half}
        self.mine = EXPERTS[0] if rank < half else EXPERTS[1]
        groups = [dist.new_group(list(range(0, half))), dist.new_group(list(range(half, world)))]
        self.group = groups[0] if rank < half else groups[1]
        self.size = half

    def gather(self, setup, optimizer: torch.optim.Optimizer | None, device: torch.device) -> None:
        """Every rank: each expert's trained tensors (and, with `optimizer`, their optimizer state) from its first
        rank, so every rank holds the whole trained state, as a single process does."""
        from modules.util.ranks import broadcast_json_from
        named = setup.named_trainable_parameters()
        for expert, owner in self.owner.items():
            parameters = [(name, p) for name, p in named if name.split(".", 1)[0] == expert]
            for _, parameter in parameters:
                _broadcast_into(parameter.data, owner, device)
            if optimizer is None:
                continue
            # the owner's optimizer state, described once (which entries are tensors of which shape), then sent
            layout = broadcast_json_from({name: _describe(optimizer.state.get(p, {})) for name, p in parameters}, owner)
            for name, parameter in parameters:
                received = _receive(optimizer.state.get(parameter, {}), layout[name], parameter, owner, device)
                if received:
                    optimizer.state[parameter] = received


def _broadcast_into(tensor: torch.Tensor, owner: int, device: torch.device) -> None:
    moved = tensor.to(device)
    dist.broadcast(moved, src=owner)
    if moved is not tensor:
        tensor.copy_(moved)


def _describe(entries: dict) -> dict:
    return {key: {"tensor": [list(value.shape), str(value.dtype).removeprefix("torch."), value.device.type == "cpu"]}
            if torch.is_tensor(value) else {"value": value} for key, value in entries.items()}


def _receive(entries: dict, layout: dict, parameter: torch.Tensor, owner: int, device: torch.device) -> dict:
    """The optimizer state of one parameter (tensors and plain numbers alike), as its owner holds it."""
    received = {}
    for key, entry in layout.items():
        if "value" in entry:
            received[key] = entry["value"]
            continue
        shape, dtype, on_cpu = entry["tensor"]
        # Adam keeps its step count on the host unless it is capturable: the copy goes where the owner's is
        tensor = entries[key] if dist.get_rank() == owner else \
            torch.empty(shape, dtype=getattr(torch, dtype), device="cpu" if on_cpu else parameter.device)
        _broadcast_into(tensor, owner, device)
        received[key] = tensor
    return received
