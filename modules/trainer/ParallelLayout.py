"""The one object that owns a run's parallel layout (DESIGN.md section 12): the device mesh, how the trained
transformer(s) are placed and wrapped (once, before the optimizer is made), this rank's forward pass, gradient sync,
the gather for saves and the loss every rank reports. The training loop calls the same methods whatever the layout.

Layouts (the data loader deals the global batch out along the data-parallel ranks, ranks.data_rank_and_size):
- one process: the experts are moved to the device as they are;
- DDP (adapters, embeddings): every rank holds the whole base; the trainable gradients are averaged;
- FSDP2 (`fully_shard` per block, then the transformer): full fine-tunes, and adapters over a frozen base with
  `distributed.shard_base`, where each rank holds 1/N of the base and FSDP2 gathers one block at a time. FSDP2 leaves
  frozen parameters out of its reduce-scatter, so only the adapters' gradients are averaged (in reduce_dtype, float32
  by default). `distributed.cpu_offload` keeps the shards in host memory (FSDP2's CPUOffloadPolicy);
- context parallel (`distributed.context_parallel` d, modules/trainer/context_parallel.py): a (dp, ring 1, ulysses d)
  mesh, each group of d ranks splitting one clip's tokens, DDP over every rank summing a group's partial gradients;
- expert parallel (A14B `both`, modules/trainer/expert_parallel.py): one expert per half of the ranks, DDP within
  each half; every micro-step trains each half's own expert at once, over its own sigma range.
"""
import contextlib
import itertools

import torch
from torch import nn

from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.ranks import broadcast_json, rank_and_world

GIB = 1024 ** 3


class TrainingStep(nn.Module):
    """The forward pass DDP wraps: predict and loss of one batch. Holding the trained parts as submodules lets DDP
    find their trainable parameters and average exactly those gradients."""

    def __init__(self, setup, parts: dict[str, nn.Module]):
        super().__init__()
        self.setup = setup
        self.parts = nn.ModuleDict(parts)

    def forward(self, batch: dict, generator: torch.Generator):
        prediction = self.setup.predict(batch, generator)
        return self.setup.calculate_loss(batch, prediction), prediction


class Parallel:
    """This process's part in the run: how its forward pass, gradient sync and gradient norm go."""

    def __init__(self, config: TrainConfig):
        self.config = config
        self.rank, self.world_size = rank_and_world()
        self.mesh = None                            # DeviceMesh ("dp",) once wrapped on several ranks
        self.step_module: nn.Module | None = None   # DDP(TrainingStep) when adapters train on several ranks
        self.sharded: dict[str, nn.Module] = {}     # expert name -> fully_shard root (fine-tunes, sharded base)
        self.base_sharded = False                   # adapters over a sharded frozen base
        self.context_parallel = config.distributed.context_parallel if self.world_size > 1 else 1
        self.experts = None                         # ExpertGroups: A14B `both` with one expert per half of the ranks

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def forward_needs_every_rank(self) -> bool:
        """A sharded model's forward gathers weights from every rank: all ranks must run each forward pass (a
        validation batch one rank lacks is run and its loss dropped; every rank computes each preview)."""
        return bool(self.sharded)

    @property
    def layout(self) -> str:
        if not self.enabled:
            return "one process"
        if self.experts is not None:
            half = self.world_size // 2
            return (f"expert parallel (high-noise expert on ranks 0-{half - 1}, low-noise expert on ranks "
                    f"{half}-{self.world_size - 1}, DDP within each)")
        if self.context_parallel > 1:
            groups = self.world_size // self.context_parallel
            return f"DDP x context parallel ({groups} data-parallel x {self.context_parallel} context-parallel)"
        if self.base_sharded:
            return "sharded base (FSDP2)" + (" with CPU offload" if self.config.distributed.cpu_offload else "")
        return "sharded (FSDP2)" if self.sharded else "DDP"

    def wrap(self, setup, model, device: torch.device) -> None:
        """Places the experts that train on the device and wraps them for the layout; before the optimizer is made
        (FSDP2 replaces parameters)."""
        if not self.enabled:
            setup.move_experts_to_device()
            return
        from torch.distributed.device_mesh import init_device_mesh

        experts = setup.experts_in_training()
        method = self.config.training_method
        from modules.trainer import expert_parallel
        if self.context_parallel > 1:
            self._context_parallel(setup, model, experts, device)
        elif expert_parallel.applies(self.config, self.world_size):
            self._expert_parallel(setup, model, device)
        elif method is TrainingMethod.FINE_TUNE:
            self.mesh = init_device_mesh(device.type, (self.world_size,), mesh_dim_names=("dp",))
            self._shard(model, experts, device, param_dtype=self.config.train_dtype.torch_dtype())
        elif method is TrainingMethod.LORA and self._shards_base(device):
            self.mesh = init_device_mesh(device.type, (self.world_size,), mesh_dim_names=("dp",))
            # adapters keep float32 and the base its own dtype, computed under autocast as in one process; FLOAT_8
            # shards are cast to bfloat16 as they are gathered (fp8_sharding)
            self.base_sharded = True
            self._shard(model, experts, device, param_dtype=fp8_sharding(model, experts), cast_inputs=False)
        else:
            setup.move_experts_to_device()
            # every rank holds the same experts: the swapped blocks' frozen host weights, one copy per machine
            from modules.trainer.shared_host import share_swapped_blocks
            share_swapped_blocks(setup, experts, device)
            parts = {name: getattr(model, name) for name in experts}
            if method is TrainingMethod.EMBEDDING:
                parts["text_encoder"] = model.text_encoder
            self._data_parallel(setup, parts, device, unused=len(experts) > 1)
        if self.is_main:
            batch, groups = self.config.batch_size, self.world_size // self.context_parallel
            if self.experts is not None:
                print(f"{self.experts.size} processes per expert x batch_size {batch}: each expert's global batch "
                      f"{self.experts.size * batch}, both experts trained in every step; layout: {self.layout}",
                      flush=True)
            else:
                print(f"{groups} data-parallel groups x batch_size {batch}: global batch {groups * batch}; "
                      f"layout: {self.layout}" if self.context_parallel > 1 else
                      f"{self.world_size} processes x batch_size {batch}: global batch {self.world_size * batch}; "
                      f"layout: {self.layout}", flush=True)

    def _expert_parallel(self, setup, model, device: torch.device) -> None:
        """Each half of the ranks holds one expert on its device (the other stays in host memory, untrained here)
        and averages its gradients over its own half."""
        from modules.trainer.expert_parallel import ExpertGroups
        self.setup, self.device = setup, device   # for gathering the experts' trained tensors
        self.experts = ExpertGroups(self.rank, self.world_size)
        mine = self.experts.mine
        setup.only_expert = mine   # every step of this rank trains its expert, as `expert: high` / `low` does
        performance = getattr(setup, "performance", {}).get(mine)
        if performance is not None:
            performance.move_to_device()
        else:
            getattr(model, mine).to(device)
        getattr(model, mine).train()
        self._data_parallel(setup, {mine: getattr(model, mine)}, device, unused=False, group=self.experts.group)

    @property
    def own_expert(self) -> str | None:
        """Expert parallel: the expert this rank trains (None: every rank trains every expert in training)."""
        return self.experts.mine if self.experts is not None else None

    def _context_parallel(self, setup, model, experts: list[str], device: torch.device) -> None:
        """A (dp, ring 1, ulysses cp) mesh: consecutive ranks split one clip's tokens (diffusers' hooks), and DDP
        over every rank sums each group's partial gradients and averages the groups."""
        from torch.distributed.device_mesh import init_device_mesh

        from modules.trainer import context_parallel
        size = self.context_parallel
        self.mesh = init_device_mesh(device.type, (self.world_size // size, 1, size),
                                     mesh_dim_names=("dp", "ring", "ulysses"))
        setup.move_experts_to_device()
        for name in experts:
            context_parallel.enable(getattr(model, name), self.mesh, device)
        parts = {name: getattr(model, name) for name in experts}
        if self.config.training_method is TrainingMethod.EMBEDDING:
            parts["text_encoder"] = model.text_encoder
        state = context_parallel.GroupSum(size, bf16=self.config.distributed.reduce_dtype == "BFLOAT_16")
        self._data_parallel(setup, parts, device, unused=len(experts) > 1,
                            hook=(state, context_parallel.group_sum_hook))

    def _shards_base(self, device: torch.device) -> bool:
        """distributed.shard_base; `auto`: rank 0 decides for all, sharding when the whole base does not fit."""
        asked = self.config.distributed.shard_base
        if asked != "auto":
            return bool(asked)
        reason = None
        if self.is_main:
            reason = self._auto_shard_reason(device)
            if reason:
                print(f"distributed.shard_base auto: sharding the frozen base ({reason})", flush=True)
        return bool(broadcast_json(reason))

    def _auto_shard_reason(self, device: torch.device) -> str | None:
        """Why `auto` shards (None: it does not). train.py decides before loading (check_fits_device, which
        writes true / false into the config); this decides for runs started otherwise."""
        config = self.config
        if config.distributed.cpu_offload:
            return "distributed.cpu_offload is set"
        if device.type != "cuda" or config.optimizer.ema or config.performance.block_swap:
            return None  # no card to overflow, or a setting that needs the whole base on every rank
        from modules.planner.parallel_plan import base_layouts, choose, plan_layouts
        from modules.planner.plan_shapes import PlanError
        try:
            plans = plan_layouts(config, self.world_size)
        except PlanError:
            return None
        free = torch.cuda.mem_get_info(device)[0] / GIB
        chosen = choose(base_layouts(plans), free)   # the data is dealt already
        if chosen.layout == "DDP":
            return None
        config.distributed.cpu_offload = chosen.config_values().get("distributed.cpu_offload", False)
        return (f"predicted peak per GPU with the whole base {plans[0].peak_gib:.1f} GiB, {free:.1f} GiB free; "
                f"{chosen.layout}: {chosen.peak_gib:.1f} GiB")

    def _data_parallel(self, setup, parts: dict[str, nn.Module], device: torch.device, unused: bool,
                       hook=None, group=None) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        step = TrainingStep(setup, parts)
        # every rank loaded the same frozen base: broadcasting it at start would move gigabytes for nothing
        frozen = [name for name, p in step.named_parameters() if not p.requires_grad]
        frozen += [name for name, _ in step.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(step, frozen)
        self.step_module = DistributedDataParallel(
            step, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False,
            process_group=group,
            # two experts: each step routes to one, the other's adapter gets no gradient that step
            find_unused_parameters=unused)
        if hook is not None:
            self.step_module.register_comm_hook(*hook)
        elif self.config.distributed.reduce_dtype == "BFLOAT_16":
            self.step_module.register_comm_hook(None, default_hooks.bf16_compress_hook)

    def _shard(self, model, experts: list[str], device: torch.device, param_dtype: torch.dtype | None,
               cast_inputs: bool = True) -> None:
        """fully_shard per block, then the transformer, from the host copy: FSDP2 moves only this rank's shard to
        the device (or keeps it in host memory with cpu_offload), so no rank ever holds the whole model there."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        reduce = torch.bfloat16 if self.config.distributed.reduce_dtype == "BFLOAT_16" else torch.float32
        # cast_inputs False: the blocks' inputs keep their dtype, autocast decides each op's, as in one process
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce, cast_forward_inputs=cast_inputs)
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if self.config.distributed.cpu_offload \
            else OffloadPolicy()
        for name in experts:
            transformer = getattr(model, name)
            for block in transformer.blocks:
                fully_shard(block, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
            fully_shard(transformer, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
            transformer.train()
            self.sharded[name] = transformer

    def forward(self, setup, batch: dict, generator: torch.Generator):
        """(loss, prediction) of this rank's share of the global batch (expert parallel: for this rank's expert)."""
        if self.step_module is not None:
            return self.step_module(batch, generator)
        prediction = setup.predict(batch, generator)
        return setup.calculate_loss(batch, prediction), prediction

    def sync_gradients(self, sync: bool) -> None:
        """Gradient accumulation: average across ranks only on the micro-step before an optimizer step."""
        if self.step_module is not None:
            self.step_module.require_backward_grad_sync = sync
        for transformer in self.sharded.values():
            transformer.set_requires_gradient_sync(sync)

    def full_trainable(self) -> dict[str, dict[str, torch.Tensor]]:
        """{expert: {name: whole tensor on the host}} of every trained parameter of the sharded experts, on rank 0
        (empty elsewhere). Every rank must call it: each tensor is all-gathered in turn, so at most one whole
        parameter is in flight on the device."""
        from torch.distributed.tensor import DTensor

        whole = {}
        for expert, transformer in self.sharded.items():
            whole[expert] = {}
            for name, parameter in transformer.named_parameters():
                if not parameter.requires_grad:
                    continue
                full = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
                if self.is_main:
                    whole[expert][name] = full.detach().cpu()
        return whole

    @contextlib.contextmanager
    def gathered(self, model):
        """For saving: on rank 0 each sharded expert appears whole to the usual savers, which write the files a
        single process would. Every rank must enter (the gather is a collective)."""
        if self.experts is not None:
            self.experts.gather(self.setup, None, self.device)
        if not self.sharded:
            yield
            return
        if self.base_sharded:
            with _standing_in(self.sharded, self.full_trainable()):
                yield
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.fsdp import FSDPModule

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = {name: get_model_state_dict(transformer, options=options) for name, transformer in self.sharded.items()}
        if not self.is_main:
            yield
            return
        for name, transformer in self.sharded.items():
            # fully_shard made the class a subclass of FSDPModule and the model's own class
            original = next(c for c in type(transformer).__mro__ if not issubclass(c, FSDPModule))
            with torch.device("meta"):
                whole = original.from_config(transformer.config)
            whole.load_state_dict(full[name], assign=True)
            for module_name, module in whole.named_modules():
                # buffers outside the state dict (rotary tables) are not sharded: take them as they are
                source = transformer.get_submodule(module_name)
                for key, buffer in module.named_buffers(recurse=False):
                    if buffer.is_meta:
                        module.register_buffer(key, source.get_buffer(key).detach().cpu(), persistent=False)
            setattr(model, name, whole.eval())
        try:
            yield
        finally:
            for name, transformer in self.sharded.items():
                setattr(model, name, transformer)

    @contextlib.contextmanager
    def previewing(self, model):
        """Around previews (every rank enters). Expert parallel: every rank gets the other expert's trained tensors
        from its ranks, and rank 0's own expert leaves its GPU meanwhile, so that the sampler moves each expert
        there for its own denoising steps (Placement) and rank 0 never holds both experts."""
        if self.experts is None:
            yield
            return
        self.experts.gather(self.setup, None, self.device)
        own = getattr(model, self.experts.mine)
        move = self.is_main and self.device.type != "cpu" and all(
            t.device == self.device for t in itertools.chain(own.parameters(), own.buffers()))
        if move:
            own.to("cpu")
        try:
            yield
        finally:
            if move:
                own.to(self.device)

    def global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The step's gradient norm on every rank: expert parallel, the norm of both experts' gradients together
        (each half clipped its own expert's, as a one-expert run does; the ranks of a half hold equal norms)."""
        if self.experts is None:
            return norm
        import torch.distributed as dist
        squared = norm.float().to(self.device).square()
        dist.all_reduce(squared)
        return (squared / self.experts.size).sqrt()

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global batch's loss, detached and left on the device: the mean of the ranks' losses (each rank's is
        weighted for padding). Expert parallel: (high-noise expert's, low-noise expert's), each the mean over its
        half; the step's loss is their mean."""
        import torch.distributed as dist

        loss = loss.detach()
        if not self.enabled:
            return loss
        if self.experts is not None:
            from modules.trainer.expert_parallel import EXPERTS
            parts = torch.zeros(len(EXPERTS), device=loss.device)
            parts[EXPERTS.index(self.experts.mine)] = loss.float()
            dist.all_reduce(parts)
            return parts / self.experts.size
        total = loss.float().clone()
        dist.all_reduce(total)
        return total / self.world_size


def fp8_sharding(model, experts: list[str]) -> torch.dtype | None:
    """FLOAT_8 base weights over a sharded base: bfloat16, the dtype FSDP2 casts every shard to before gathering it
    (None: no expert stores float8). In one process diffusers' layerwise casting upcasts each layer's float8 weights
    to bfloat16 for its forward pass and back after; over a sharded base the layers' parameters are FSDP2's, so its
    mixed-precision cast does that instead (the same bfloat16 values) and the casting hooks stand down. The shards
    stay float8 (1 byte a weight); the adapters are cast to bfloat16 for the forward pass, which autocast does to
    them in one process anyway, and their gradients are reduced in float32 into their float32 shards. The cast is
    per block, not per parameter: the modulation tables diffusers keeps in float32 are rounded to bfloat16 too."""
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    found = False
    for name in experts:
        for module in getattr(model, name).modules():
            registry = getattr(module, "_diffusers_hook", None)
            for hook in (registry.hooks.values() if registry is not None else ()):
                if isinstance(hook, LayerwiseCastingHook) and hook.storage_dtype == torch.float8_e4m3fn:
                    hook.pre_forward = lambda _module, *args, **kwargs: (args, kwargs)
                    hook.post_forward = lambda _module, output: output
                    found = True
    return torch.bfloat16 if found else None


@contextlib.contextmanager
def _standing_in(sharded: dict[str, nn.Module], whole: dict[str, dict[str, torch.Tensor]]):
    """Adapters over a sharded base, on rank 0: the whole trained tensors stand in for their shards while the
    savers read them (they read adapters module by module); the frozen base is never gathered. The shards go back
    before any forward pass, so FSDP2 finds its own parameters again."""
    replaced = []
    try:
        for expert, tensors in whole.items():
            for name, tensor in tensors.items():
                module_name, _, leaf = name.rpartition(".")
                module = sharded[expert].get_submodule(module_name)
                replaced.append((module, leaf, module._parameters[leaf]))
                module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        yield
    finally:
        for module, leaf, parameter in reversed(replaced):
            module._parameters[leaf] = parameter
