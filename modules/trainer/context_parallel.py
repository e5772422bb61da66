"""Context parallel (`distributed.context_parallel: N`, docs/multi-gpu.md): one clip's tokens split over N ranks, with
diffusers' own context-parallel hooks and Ulysses attention.

diffusers' `WanTransformer3DModel._cp_plan` splits the tokens at the first block's input (and the rotary tables and
TI2V-5B's per-token timesteps alike) and gathers them at `proj_out`; inside each self-attention, Ulysses'
all-to-all trades the token split for a head split (each rank attends over every token with 1/N of the heads) and
back. Cross-attention keeps the whole text on every rank. Ulysses rather than ring attention: one all-to-all before
and one after each attention, no per-step rotation, and diffusers' native (torch SDPA) backend supports it with its
backward pass, on NCCL and on gloo; it needs the head count and the token count to divide by N, checked before any
model loads (`problems`).

What this means for the gradients: every rank of a group computes the same loss on the gathered prediction, and the
gather's backward hands each rank only its own tokens' part, so each rank's parameter gradient is a partial sum over
its tokens; the group's sum is the whole gradient (`group_sum_hook` makes DDP sum over the group and average
over the data-parallel groups).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.TrainingMethod import TrainingMethod

# performance.attention -> whether diffusers' dispatcher backend has a context-parallel path ("auto": native SDPA)
SUPPORTED_ATTENTION = ("auto", "flash", "cudnn")


def problems(config: TrainConfig, world: int) -> list[str]:
    """What stops `distributed.context_parallel` before any model loads, all at once; `world`: the processes the
    run will have."""
    size = config.distributed.context_parallel
    if size == 1:
        return []
    found = []
    if world == 1:
        found.append(f"distributed.context_parallel: {size} needs several processes (multi_gpu with "
                     f"distributed.processes, or torchrun); this run has one")
    elif world % size:
        found.append(f"distributed.context_parallel: {size} does not divide the {world} processes (each "
                     f"data-parallel group holds {size} of them)")
    if config.training_method is TrainingMethod.FINE_TUNE or config.distributed.shard_base is True \
            or config.distributed.cpu_offload:
        found.append("distributed.context_parallel: works with a whole base on every GPU (LoRA and embeddings over "
                     "DDP); not yet with a sharded fine-tune, distributed.shard_base or cpu_offload")
    if config.performance.attention not in SUPPORTED_ATTENTION:
        found.append(f"performance.attention: {config.performance.attention!r} has no context-parallel path in "
                     f"diffusers; use one of {', '.join(SUPPORTED_ATTENTION)}")
    if config.performance.block_swap:
        found.append("performance.block_swap: not with distributed.context_parallel (each GPU holds the whole base); "
                     "set it to 0")
    found += _shape_problems(config, size)
    return found


def _shape_problems(config: TrainConfig, size: int) -> list[str]:
    """Heads and the token count of every bucket must divide by `size` (Ulysses splits both evenly)."""
    from modules.planner.plan_shapes import PlanError, resolve_architecture
    from modules.util.resolution import make_buckets
    try:
        arch = resolve_architecture(config)
    except PlanError:
        return []   # the model is not readable yet: the loader reports it
    found = []
    heads = arch.transformer["num_attention_heads"]
    if heads % size:
        found.append(f"distributed.context_parallel: the model's {heads} attention heads do not divide over {size} "
                     f"GPUs (Ulysses gives each GPU heads / {size}); use a divisor of {heads}")
    uneven = [f"{frames}x{width}x{height} ({token_count(arch, frames, height, width)})"
              for height, width in make_buckets(config.data.resolution, config.data.aspect_ratios, arch.spatial_unit)
              for frames in config.data.frame_buckets if token_count(arch, frames, height, width) % size]
    if uneven:
        unit = arch.spatial_unit
        found.append(f"data.frame_buckets / data.resolution: the tokens (latent frames x height/{unit} x "
                     f"width/{unit}) of {', '.join(uneven)} do not divide over {size} GPUs; choose sides whose "
                     f"multiples of {unit} make an even split (832x480 and 1280x720 do for 2, 4 and 8)")
    return found


def token_count(arch, frames: int, height: int, width: int) -> int:
    _, t, h, w = arch.latent_shape(frames, height, width)
    patch = arch.transformer["patch_size"]
    return (t // patch[0]) * (h // patch[1]) * (w // patch[2])


def enable(transformer: torch.nn.Module, mesh, device: torch.device) -> None:
    """Splits `transformer`'s tokens over the mesh's "ring" x "ulysses" ranks (ring 1: Ulysses only).

    diffusers' `enable_parallelism` does these three steps, but first places the model on
    `torch.device(accelerator, rank % accelerator count)`, which divides by zero on a CPU-only machine; the steps
    themselves are diffusers' own."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    size = mesh["ulysses"].size()
    config = ParallelConfig(context_parallel_config=ContextParallelConfig(ulysses_degree=size, mesh=mesh))
    config.setup(torch.distributed.get_rank(), torch.distributed.get_world_size(), device, mesh=mesh)
    transformer._parallel_config = config
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(transformer, config.context_parallel_config, transformer._cp_plan)


@dataclass(frozen=True)
class GroupSum:
    """The state of `group_sum_hook`: the context-parallel group size, and whether to average in bfloat16."""
    size: int
    bf16: bool = False


def group_sum_hook(state: GroupSum, bucket):
    """DDP communication hook over the whole (dp x cp) world (`register_comm_hook(GroupSum(...), group_sum_hook)`):
    the sum over a context-parallel group (each rank's gradient is its tokens' part) averaged over the data-parallel
    groups. torch's own hooks average over every rank, so the bucket is first multiplied by the group size."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    bucket.buffer().mul_(state.size)
    hook = default_hooks.bf16_compress_hook if state.bf16 else default_hooks.allreduce_hook
    return hook(None, bucket)
