"""The step time of each multi-GPU layout (parallel_plan's LayoutPlan), from the same nominal cost model as the
memory switches (auto_fit: COMPUTE_RATE for the blocks' FLOPs, the switches' own cost) plus what each layout moves
between GPUs, and the work a step does: how many clips it trains on and how many expert updates it makes.

Per rank and step, with C = 3 forward passes' worth of the blocks' FLOPs for the per-GPU batch (forward, backward)
plus the switches' cost (checkpoint recomputation, exposed swap and offload copies):
- DDP: C + the trainable gradients' all-reduce (ring: 2 (N-1)/N of their bytes), not overlapped (an upper bound).
- sharded base: the base is all-gathered per block in the forward pass and again in the backward pass (2 (N-1)/N
  of one expert's weights a step), overlapped with the blocks' compute by FSDP2's prefetch: max(C, gathers), plus
  the adapters' reduce-scatter.
- sharded base + CPU offload: as the sharded base, and every shard crosses PCIe to the GPU twice a step.
- context parallel d: C / d (each rank computes 1/d of the tokens, attention included) plus Ulysses' four
  all-to-alls per self-attention in the forward pass and four in the backward pass, each moving (d-1)/d of the
  rank's q / k / v / output, not overlapped; the gradient all-reduce as DDP.
- expert parallel: C of one expert on every rank (each half trains its own), and the all-reduce within a half.
Every layout's clips per step is batch_size x its data-parallel groups; A14B `both` makes one expert update per
step (a step is routed to one expert), except expert parallel, which makes two (a high-noise and a low-noise step).

LINK_RATE is PCIe 4.0 x16 between GPUs (the common two-card workstation, the slow case); NVLink moves the same
bytes 10 to 20 times faster, so communication-bound layouts (sharded base, context parallel) are slower here than on
a server. These are predictions from nominal rates, not measurements.
"""
from __future__ import annotations

from modules.planner.auto_fit import COMPUTE_RATE, TRANSFER_RATE, settings_of, step_cost

LINK_RATE = 20e9   # bytes/s between two GPUs over PCIe 4.0 x16 (no NVLink)


def step_seconds(config, arch, shape, prediction, plans, shares) -> None:
    """Fills each plan's step_seconds, clips_per_step and expert_updates (plans of parallel_plan.plan_layouts)."""
    two = arch.variant.has_two_experts and config.expert == "both"
    weights, trained = prediction.parts["weights"], prediction.parts["trainable + grads + optimizer"]
    expert_weights = weights / (2 if two else 1)
    gradients = trained / 4   # float32 gradients: a fourth of AdamW's weights, gradients and two moments
    cost = step_cost(arch, shape, int(expert_weights * shares.block))
    compute = 3 * cost.layers * cost.block_forward_seconds + cost.seconds(settings_of(config))
    for plan in plans:
        n, layout = plan.gpus, plan.layout
        groups = n
        if layout == "DDP":
            seconds = compute + _all_reduce(gradients, n)
        elif layout.startswith("sharded base"):
            gathers = 2 * expert_weights * (n - 1) / n / LINK_RATE
            if layout.endswith("CPU offload"):
                gathers += 2 * expert_weights / n / TRANSFER_RATE
            seconds = max(compute, gathers) + _all_reduce(gradients, n) / 2
        elif layout.startswith("context parallel"):
            size = plan.context_parallel
            groups = n // size
            seconds = compute / size + _all_to_all(arch, shape, cost.layers, size) + _all_reduce(gradients, n)
        else:   # expert parallel: each half trains its own expert
            seconds = compute + _all_reduce(gradients / (2 if two else 1), n // 2)
        plan.step_seconds = seconds
        plan.clips_per_step = shape.batch_size * groups
        plan.expert_updates = 2 if layout == "expert parallel" and two else 1


def _all_reduce(nbytes: float, ranks: int) -> float:
    return 2 * nbytes * (ranks - 1) / ranks / LINK_RATE if ranks > 1 else 0.0


def _all_to_all(arch, shape, layers: int, size: int) -> float:
    """Ulysses: q, k, v and the output of every self-attention, forward and backward, (d-1)/d of each moved."""
    c = arch.transformer
    _z, frames, height, width = arch.latent_shape(shape.frames, shape.height, shape.width)
    tokens = frames * (height // c["patch_size"][1]) * (width // c["patch_size"][2])
    per_rank = shape.batch_size * tokens / size * arch.dim * 2   # bf16 activations of one projection
    return layers * 2 * 4 * per_rank * (size - 1) / size / LINK_RATE


def work_text(plan) -> str:
    """'x.xx s/step, 2 clips, 1 expert update' in the report's words."""
    updates = "both experts updated" if plan.expert_updates == 2 else "one update"
    return f"{plan.step_seconds:.2f} s/step, {plan.clips_per_step} clip(s), {updates}"


def compute_rate_note() -> str:
    return (f"step times predicted at {COMPUTE_RATE / 1e12:.0f} TFLOP/s and {LINK_RATE / 1e9:.0f} GB/s between GPUs "
            f"(PCIe; NVLink is faster), not measured")
