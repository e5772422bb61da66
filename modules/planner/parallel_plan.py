"""Planned per GPU: each rank's predicted peak for every multi-GPU layout (docs/multi-gpu.md), derived from the
single-process trace of the run's step (memory_plan.predict, with the per-GPU batch), and the layout
`performance.auto_fit` and `distributed.shard_base: auto` choose.

How a layout changes one rank's memory, against one process holding the whole run (parts of the traced peak:
W frozen weights, T trainable weights + gradients + optimizer state, A activations, X transients):
- DDP: everything of one process, plus DDP's gradient buckets (a copy of the trainable gradients).
- sharded base (FSDP2 per block): W / N and T / N, plus what is gathered whole while it computes: the block that
  runs and the next one (FSDP2 fetches ahead), and the parts outside the blocks (patch and condition embedders,
  head), which stay gathered from the forward pass to the backward pass.
- sharded base with CPU offload: the shards live in host memory; the GPU holds only the gathered blocks and parts.
- expert parallel (A14B `expert: both`, LoRA): each rank holds one expert: W / 2 and T / 2 of a `both` run, and
  DDP's buckets for its adapter.
- context parallel d (d dividing N; N / d data-parallel groups): one clip's tokens split d ways: A / d and X / d,
  weights whole, DDP's gradient buckets as DDP.
Each plan also carries its predicted step time and the work a step does (parallel_time.py): expert parallel makes
two expert updates a step (a high-noise and a low-noise step at once) where every other layout of A14B `both` makes
one.

Tolerance: the per-GPU figures inherit the single trace's (within 5 % of a real step) and count the gathered
blocks in full on top of their shards (at most 2 blocks / N too many): they err on the safe side by that much.
"""
from __future__ import annotations

from dataclasses import dataclass

from modules.planner.Prediction import GIB, Prediction, allowance_bytes
from modules.util.config.TrainConfig import TrainConfig

TOLERANCE = 0.05
# fastest first: the order auto_fit and shard_base auto prefer among the layouts that fit (expert parallel first:
# for A14B `both` it makes two expert updates in the time DDP makes one)
BUILT = ("expert parallel", "DDP", "sharded base", "context parallel", "sharded base + CPU offload")


@dataclass
class LayoutPlan:
    layout: str
    gpus: int
    traced_bytes: int           # one rank's counted peak
    host_bytes: int             # what the layout keeps in each rank's host memory instead
    holds: str                  # what each GPU holds, in words
    built: bool = True          # False: planned only, the trainer cannot run it yet
    problem: str = ""           # why the layout cannot run this config (heads that do not divide, one expert)
    expert_choice: bool = False  # an A14B `both` run that could be expert parallel: this layout turns it off
    step_seconds: float = 0.0   # predicted time of one step (parallel_time.py)
    clips_per_step: int = 0     # clips one step trains on, all ranks together
    expert_updates: int = 1     # expert updates a step makes (expert parallel: 2, a high-noise and a low-noise step)

    @property
    def peak_bytes(self) -> int:
        return self.traced_bytes + allowance_bytes(self.traced_bytes)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / GIB

    def fits(self, vram_gib: float) -> bool:
        return not self.problem and self.peak_bytes <= vram_gib * GIB

    @property
    def context_parallel(self) -> int:
        return int(self.layout.rsplit(" ", 1)[1]) if self.layout.startswith("context parallel") else 1

    def config_values(self) -> dict:
        if self.layout == "expert parallel":
            return {"distributed.expert_parallel": True, "distributed.shard_base": False,
                    "distributed.cpu_offload": False}
        return ({"distributed.expert_parallel": False} if self.expert_choice else {}) | self._base_values()

    def _base_values(self) -> dict:
        if self.context_parallel > 1:
            return {"distributed.shard_base": False, "distributed.cpu_offload": False,
                    "distributed.context_parallel": self.context_parallel}
        return {"DDP": {"distributed.shard_base": False},
                "sharded base": {"distributed.shard_base": True, "distributed.cpu_offload": False},
                "sharded base + CPU offload": {"distributed.shard_base": True,
                                               "distributed.cpu_offload": True}}.get(self.layout, {})


@dataclass
class BlockShares:
    block: float      # one block's share of an expert's weights
    outside: float    # the share outside the blocks (embedders, head)


def block_shares(arch) -> BlockShares:
    """Counted from the transformer built on the meta device (no memory, no weights)."""
    from modules.planner.step_trace import _skeleton
    transformer = _skeleton(arch)
    total = sum(p.numel() for p in transformer.parameters())
    blocks = [sum(p.numel() for p in block.parameters()) for block in transformer.blocks]
    return BlockShares(block=max(blocks) / total, outside=(total - sum(blocks)) / total)


def plan_layouts(config: TrainConfig, gpus: int, prediction: Prediction | None = None, arch=None,
                 shape=None) -> list[LayoutPlan]:
    """Each layout's per-GPU peak for `gpus` GPUs (batch_size per GPU, as the trainer reads it); `prediction`:
    predict(config), when the caller has it."""
    from modules.planner.memory_plan import predict
    from modules.planner.parallel_time import step_seconds
    from modules.planner.plan_shapes import largest_shape, resolve_architecture
    arch = arch or resolve_architecture(config)
    shape = shape or largest_shape(config, arch)
    prediction = prediction or predict(config, shape, arch)
    unswapped = prediction
    if config.performance.block_swap:
        # a sharded base cannot swap blocks (the shards are split already): its layouts start from the run without
        unswapped = predict(config.model_copy(update={"performance": config.performance.model_copy(
            update={"block_swap": 0})}), shape, arch)
    n = max(1, gpus)
    shares = block_shares(arch)
    plans = _sharded_layouts(config, arch, unswapped, n, shares)
    plans[:0] = [LayoutPlan("DDP", n, prediction.counted_bytes + _ddp_buckets(config, prediction), 0,
                            "the whole base and the adapters; gradients averaged",
                            problem="a fine-tune is always sharded (FSDP2)"
                            if config.training_method.value == "FINE_TUNE" else "")]
    plans += _context_parallel(config, prediction, n)
    experts = _expert_parallel(config, arch, prediction, n)
    if not experts[0].problem:
        # the trainer runs A14B `both` expert parallel whenever it can (distributed.expert_parallel): the others
        # are chosen with it turned off
        for plan in plans:
            plan.expert_choice = True
    plans += experts
    step_seconds(config, arch, shape, prediction, plans, shares)
    return plans


def _ddp_buckets(config: TrainConfig, prediction: Prediction) -> int:
    # adapter gradients are float32: a fourth of T for AdamW's weights, gradients and two moments
    trained = prediction.parts["trainable + grads + optimizer"]
    return trained // 4 if config.training_method.value == "LORA" else 0


def _sharded_layouts(config: TrainConfig, arch, prediction: Prediction, n: int,
                     shares: BlockShares) -> list[LayoutPlan]:
    parts = prediction.parts
    traced = prediction.counted_bytes
    weights, trained = parts["weights"], parts["trainable + grads + optimizer"]
    two = arch.variant.has_two_experts and config.expert == "both"
    # one expert runs at a time; FSDP2 gathers a block's adapters (float32) with its frozen weights; FLOAT_8 shards
    # are gathered as bfloat16 (ParallelLayout.fp8_sharding), twice their bytes
    fp8 = config.training_method.value == "LORA" and any(
        getattr(config.model, part).weight_dtype.value == "FLOAT_8" for part in ("transformer", "transformer_2"))
    expert_weights = ((2 if fp8 else 1) * weights + 4 * prediction.trainable_parameters) / (2 if two else 1)
    gathered = int(expert_weights * (2 * shares.block + shares.outside))
    rest = traced - weights - trained
    return [
        LayoutPlan("sharded base", n, rest + weights // n + trained // n + gathered, 0,
                   f"1/{n} of the base, adapters and optimizer state; one block gathered whole at a time"),
        LayoutPlan("sharded base + CPU offload", n, rest + gathered, (weights + trained) // n,
                   f"the gathered blocks only; 1/{n} of the base and optimizer state in host memory"),
    ]


def _expert_parallel(config: TrainConfig, arch, prediction: Prediction, n: int) -> list[LayoutPlan]:
    """A14B `both`: each half of the GPUs holds one expert and its adapter (half of both experts' weights and
    trained state), with DDP's buckets for that adapter; each half trains its expert in every step."""
    parts = prediction.parts
    weights, trained = parts["weights"], parts["trainable + grads + optimizer"]
    two = arch.variant.has_two_experts and config.expert == "both"
    problem = "" if two else "needs a two-expert model (A14B) with expert: both"
    if two and n % 2:
        problem = "needs an even number of GPUs (half for each expert)"
    elif two and config.training_method.value != "LORA":
        problem = "LoRA only (a fine-tune of both experts is sharded)"
    return [LayoutPlan("expert parallel", n, prediction.counted_bytes - weights // 2 - trained // 2
                       + _ddp_buckets(config, prediction) // 2, 0,
                       f"one expert and its adapter per GPU ({n // 2} GPUs per expert), both experts trained in "
                       f"every step", problem=problem)]


def _context_parallel(config: TrainConfig, prediction: Prediction, n: int) -> list[LayoutPlan]:
    """One plan per context-parallel size d > 1 dividing n (the whole base on every GPU, 1/d of the tokens)."""
    from modules.trainer.context_parallel import problems
    parts = prediction.parts
    traced = prediction.counted_bytes
    split = parts["activations"] + parts["transient"]
    plans = []
    for size in (d for d in range(2, n + 1) if n % d == 0):
        trial = config.model_copy(update={"distributed": config.distributed.model_copy(update={
            "context_parallel": size, "shard_base": False, "cpu_offload": False})})
        found = problems(trial, n)
        plans.append(LayoutPlan(f"context parallel {size}", n, traced - split + split // size
                                + _ddp_buckets(config, prediction), 0,
                                f"the whole base; 1/{size} of each clip's tokens ({n // size} data-parallel "
                                f"groups of {size})",
                                problem="; ".join(p.split(": ", 1)[1] for p in found)))
    return plans


def choose(plans: list[LayoutPlan], vram_gib: float | None) -> LayoutPlan:
    """The fastest built layout that fits `vram_gib` (no size: DDP); else the built one with the smallest peak."""
    built = sorted((p for p in plans if p.built and not p.problem),
                   key=lambda p: BUILT.index(p.layout.rstrip("0123456789 ")))
    built = built or plans[:1]
    if vram_gib is None:
        return built[0]
    fitting = [p for p in built if p.fits(vram_gib)]
    return fitting[0] if fitting else min(built, key=lambda p: p.peak_bytes)


def report(plans: list[LayoutPlan], chosen: LayoutPlan, vram_gib: float | None) -> str:
    from modules.planner.parallel_time import compute_rate_note, work_text
    lines = [f"per GPU on {chosen.gpus} GPUs (batch_size per GPU; allowance included):"]
    for plan in plans:
        verdict = "" if vram_gib is None or plan.problem else (" fits" if plan.fits(vram_gib) else " does not fit")
        note = f" ({plan.problem})" if plan.problem else ("" if plan.built else " (planned only: not built yet)")
        host = f", host {plan.host_bytes / GIB:.1f} GiB" if plan.host_bytes else ""
        work = "" if plan.problem else f"; {work_text(plan)}"
        lines.append(f"  {plan.layout:<28}{plan.peak_gib:7.1f} GiB{host}{verdict}{note}: {plan.holds}{work}")
    lines.append(compute_rate_note())
    gain = expert_parallel_gain(plans)
    if gain:
        lines.append(gain)
    lines.append(f"predicted peak per GPU: {chosen.peak_gib:.1f} GiB ({chosen.layout})")
    return "\n".join(lines)


def expert_parallel_gain(plans: list[LayoutPlan]) -> str:
    """A14B `both`: expert parallel's expert updates per second against DDP's (each of which updates one expert)."""
    by_name = {p.layout: p for p in plans}
    experts, ddp = by_name.get("expert parallel"), by_name.get("DDP")
    if experts is None or experts.problem or ddp is None or not experts.step_seconds:
        return ""
    updates = (experts.expert_updates / experts.step_seconds) / (ddp.expert_updates / ddp.step_seconds)
    clips = (experts.clips_per_step / experts.step_seconds) / (ddp.clips_per_step / ddp.step_seconds)
    return (f"expert parallel: {experts.expert_updates} expert updates a step ({experts.clips_per_step // 2} clip(s) "
            f"each) against DDP's 1 ({ddp.clips_per_step} clip(s)): x{updates:.2f} expert updates per second, "
            f"x{clips:.2f} clips per second")


def configured(plans: list[LayoutPlan], config: TrainConfig, vram_gib: float | None) -> LayoutPlan:
    """The layout the config asks for (`shard_base: auto`: what `choose` picks for `vram_gib`)."""
    by_name = {p.layout: p for p in plans}
    experts = by_name.get("expert parallel")
    if config.distributed.expert_parallel and experts is not None and not experts.problem:
        return experts   # what the trainer runs for A14B `both` on an even number of GPUs
    if config.distributed.context_parallel > 1:
        return by_name.get(f"context parallel {config.distributed.context_parallel}", plans[0])
    shard = config.distributed.shard_base
    if config.training_method.value == "FINE_TUNE" or shard is True or config.distributed.cpu_offload:
        return by_name["sharded base + CPU offload" if config.distributed.cpu_offload else "sharded base"]
    if shard is False:
        return by_name["DDP"]
    return choose(base_layouts(plans), vram_gib)


def base_layouts(plans: list[LayoutPlan]) -> list[LayoutPlan]:
    """What `shard_base: auto` chooses among: the base's layout only (the token split and the experts' placement
    are the config's, or auto_fit's)."""
    return [p for p in plans if p.context_parallel == 1 and p.layout != "expert parallel"]
