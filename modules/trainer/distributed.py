"""Several training processes on torch.distributed (docs/multi-gpu.md): joining the group torchrun describes,
re-launching through torchrun's API for `multi_gpu: true`, and wrapping the trained model: DDP for adapters and
embeddings, FSDP2 (`fully_shard` per transformer block, then the root) for full fine-tunes.

Contract. torchrun (or `relaunch`) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; every rank runs
the same trainer on the same config. The data loader deals each global batch out to the ranks
(RankBucketBatch); `Parallel.forward` runs one rank's share and DDP / FSDP2 average the gradients, so a step
equals the single-process step on the global batch. Without WORLD_SIZE > 1 everything here is the plain
single-process path. Communication is torch.distributed's own: NCCL on NVIDIA, RCCL on ROCm (torch names it
"nccl" too), gloo on CPU; every collective has the configured timeout, so a lost rank stops the job.
"""
import contextlib
import datetime
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.ranks import rank_and_world


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def backend_for(device: torch.device) -> str:
    # ROCm builds of torch run RCCL under the name "nccl"
    return "nccl" if device.type == "cuda" else "gloo"


def join_process_group(config: TrainConfig) -> torch.device | None:
    """Joins the process group torchrun described and returns this rank's device (cuda:LOCAL_RANK, or the CPU);
    None when the process runs alone."""
    if not launched_by_torchrun():
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    wants_gpu = config.device == "auto" or config.device.startswith("cuda")
    if wants_gpu and torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device),
                                timeout=datetime.timedelta(minutes=config.distributed.timeout_minutes))
    return device


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def process_count(config: TrainConfig) -> int:
    """`multi_gpu`: the processes to launch (distributed.processes, else one per visible GPU)."""
    return config.distributed.processes or torch.cuda.device_count()


def config_problems(config: TrainConfig) -> list[str]:
    """What stops a multi-process run before any model loads (for ConfigError)."""
    several = launched_by_torchrun() or (config.multi_gpu and process_count(config) > 1)
    problems = []
    if config.multi_gpu and not launched_by_torchrun() and process_count(config) == 0:
        problems.append("multi_gpu: no GPU is visible; set distributed.processes to run several CPU processes, or "
                        "turn multi_gpu off")
    if several and config.training_method is TrainingMethod.FINE_TUNE and config.optimizer.ema:
        problems.append("optimizer.ema: not supported with a sharded (FSDP2) multi-GPU fine-tune yet; turn it off "
                        "or train on one GPU")
    if several and config.training_method is TrainingMethod.FINE_TUNE and config.performance.block_swap:
        problems.append("performance.block_swap: a sharded (FSDP2) multi-GPU fine-tune already splits the weights "
                        "across the GPUs; block swap cannot move sharded blocks: set it to 0")
    if several and config.training_method is TrainingMethod.FINE_TUNE and config.sampling.samples_file:
        # rank 0 alone would run the sharded transformer, whose forward needs every rank: a deadlock
        problems.append("sampling.samples_file: previews during a sharded (FSDP2) multi-GPU fine-tune are not "
                        "supported yet; sample the saved model with scripts/sample.py, or train on one GPU")
    return problems


def relaunch(config: TrainConfig, script: str, argv: list[str]) -> int:
    """`multi_gpu: true`: runs `script argv` in `process_count` processes on this machine through torchrun's
    launcher (the same agent as the `torchrun` command) and returns the exit code. A failing rank makes the agent
    stop the others; its error is printed by the rank itself."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    count = process_count(config)
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=count, run_id=f"wan-train-{os.getpid()}",
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.5)
    print(f"multi_gpu: launching {count} processes (global batch = {config.batch_size} x {count})", flush=True)
    try:
        elastic_launch(launch, entrypoint=sys.executable)(script, *argv)
    except ChildFailedError as error:
        rank, first = min(error.failures.items(), key=lambda item: item[1].timestamp)  # {global rank: failure}
        print(f"train: rank {rank} failed with exit code {first.exitcode}; the job was stopped", file=sys.stderr)
        return 1
    except SignalException as signal_received:
        # Ctrl-C: the launcher passed the signal on; the ranks stop after their step and rank 0 writes a backup,
        # within the 30 s the launcher grants before it kills them
        print(f"train: stopped by {signal_received.sigval.name}", file=sys.stderr)
        return 1
    return 0


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
        self.step_module: nn.Module | None = None   # DDP(TrainingStep) when adapters train on several ranks
        self.sharded: dict[str, nn.Module] = {}     # expert name -> fully_shard root (fine-tunes)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, setup, model, device: torch.device) -> None:
        """DDP or FSDP2 around the parts that train; before the optimizer is made (FSDP2 replaces parameters)."""
        if not self.enabled:
            return
        if self.is_main:
            batch = self.config.batch_size
            print(f"{self.world_size} processes x batch_size {batch}: global batch {self.world_size * batch}",
                  flush=True)
        experts = setup.experts_in_training()
        if self.config.training_method is TrainingMethod.FINE_TUNE:
            self._shard(model, experts, device)
        else:
            parts = {name: getattr(model, name) for name in experts}
            if self.config.training_method is TrainingMethod.EMBEDDING:
                parts["text_encoder"] = model.text_encoder
            self._data_parallel(setup, parts, device, unused=len(experts) > 1)

    def _data_parallel(self, setup, parts: dict[str, nn.Module], device: torch.device, unused: bool) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel

        step = TrainingStep(setup, parts)
        # every rank loaded the same frozen base: broadcasting it at start would move gigabytes for nothing
        frozen = [name for name, p in step.named_parameters() if not p.requires_grad]
        frozen += [name for name, _ in step.named_buffers()]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(step, frozen)
        self.step_module = DistributedDataParallel(
            step, device_ids=[device.index] if device.type == "cuda" else None, forward_sync_buffers=False,
            # two experts: each step routes to one, the other's adapter gets no gradient that step
            find_unused_parameters=unused)
        if self.config.distributed.reduce_dtype == "BFLOAT_16":
            self.step_module.register_comm_hook(None, default_hooks.bf16_compress_hook)

    def _shard(self, model, experts: list[str], device: torch.device) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        reduce = torch.bfloat16 if self.config.distributed.reduce_dtype == "BFLOAT_16" else torch.float32
        policy = MixedPrecisionPolicy(param_dtype=self.config.train_dtype.torch_dtype(), reduce_dtype=reduce)
        for name in experts:
            transformer = getattr(model, name)
            for block in transformer.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(transformer, mp_policy=policy)
            self.sharded[name] = transformer

    def forward(self, setup, batch: dict, generator: torch.Generator):
        """(loss, prediction) of this rank's share of the global batch."""
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

    @contextlib.contextmanager
    def gathered(self, model):
        """For saving: on rank 0 each sharded expert is swapped for a whole copy of it, so the usual savers write
        the files a single process would. Every rank must enter (the gather is a collective)."""
        if not self.sharded:
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

    def global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The global batch's loss, detached and left on the device: the mean of the ranks' losses (each rank's is
        weighted for padding)."""
        loss = loss.detach()
        if not self.enabled:
            return loss
        total = loss.float().clone()
        dist.all_reduce(total)
        return total / self.world_size


def gradient_norm(parameters: list[nn.Parameter], clip: float) -> torch.Tensor:
    """The total gradient norm (after clipping to `clip` when set), left on the device; sharded gradients give the
    global norm."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if clip:
        norm = torch.nn.utils.clip_grad_norm_(parameters, clip)
    elif grads:
        norm = torch.nn.utils.get_total_norm(grads)
    else:
        return torch.zeros(())
    return norm.full_tensor() if isinstance(norm, DTensor) else norm
