"""Several training processes on torch.distributed (docs/multi-gpu.md): joining the group torchrun describes,
re-launching through torchrun's API for `multi_gpu: true`, the settings that cannot work, and the gradient norm of
sharded gradients. How the model is wrapped (DDP, FSDP2) is ParallelLayout's.

Contract. torchrun (or `relaunch`) sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; every rank runs
the same trainer on the same config. The data loader deals each global batch out to the ranks
(RankBucketBatch); `Parallel.forward` runs one rank's share and DDP / FSDP2 average the gradients, so a step
equals the single-process step on the global batch. Without WORLD_SIZE > 1 everything here is the plain
single-process path. Communication is torch.distributed's own: NCCL on NVIDIA, RCCL on ROCm (torch names it
"nccl" too), gloo on CPU; every collective has the configured timeout, so a lost rank stops the job.
"""
import datetime
import logging
import os
import signal
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn

from modules.trainer import context_parallel, expert_parallel
from modules.util.config.TrainConfig import TrainConfig
from modules.util.enum.TrainingMethod import TrainingMethod
from modules.util.launcher_watch import ENVIRONMENT_VARIABLE as LAUNCHER_PID, die_with_launcher
from modules.util.ranks import set_context_parallel, set_expert_parallel

log = logging.getLogger(__name__)


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
    die_with_launcher()   # an orphaned rank would train on beside a rerun of the command
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
    set_context_parallel(config.distributed.context_parallel)
    set_expert_parallel(expert_parallel.applies(config, dist.get_world_size()))
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
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else \
        process_count(config) if config.multi_gpu else 1
    problems = context_parallel.problems(config, max(world, 1)) + expert_parallel.problems(config, max(world, 1))
    if config.multi_gpu and not launched_by_torchrun() and process_count(config) == 0:
        problems.append("multi_gpu: no GPU is visible; set distributed.processes to run several CPU processes, or "
                        "turn multi_gpu off")
    sharded = several and (config.training_method is TrainingMethod.FINE_TUNE or _shard_base_asked(config) is True)
    what = "fine-tune" if config.training_method is TrainingMethod.FINE_TUNE else "run (distributed.shard_base)"
    if sharded and config.optimizer.ema:
        problems.append(f"optimizer.ema: not supported with a sharded (FSDP2) multi-GPU {what} yet; turn it off "
                        f"or train on one GPU")
    if sharded and config.performance.block_swap:
        problems.append(f"performance.block_swap: a sharded (FSDP2) multi-GPU {what} already splits the weights "
                        f"across the GPUs; block swap cannot move sharded blocks: set it to 0 (distributed.cpu_offload "
                        f"keeps the shards in host memory instead)")
    if config.training_method is TrainingMethod.EMBEDDING and config.distributed.shard_base is True:
        problems.append("distributed.shard_base: embeddings train in the text encoder, not the transformer; set it "
                        "to false or auto")
    if config.distributed.cpu_offload and config.training_method is not TrainingMethod.FINE_TUNE \
            and config.distributed.shard_base is False:
        problems.append("distributed.cpu_offload: offloads the shards of a sharded run; with shard_base false every "
                        "GPU holds the whole base: set shard_base to true or auto, or turn cpu_offload off")
    if config.distributed.shard_base is True and not several \
            and config.training_method is not TrainingMethod.EMBEDDING:
        log.warning("distributed.shard_base: true splits the frozen base over several processes, but this run has "
                    "one process (multi_gpu off, or one process to launch): it is ignored")
    return problems


def _shard_base_asked(config: TrainConfig) -> bool | str:
    """True / False as set (cpu_offload makes `auto` shard); otherwise "auto" is decided from the memory plan, and
    is off where it cannot work."""
    if config.training_method is not TrainingMethod.LORA:
        return False
    shard = config.distributed.shard_base
    return True if shard == "auto" and config.distributed.cpu_offload else shard


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
    # the ranks watch this process (modules/util/launcher_watch.py): killed, it takes them with it
    previous_pid, os.environ[LAUNCHER_PID] = os.environ.get(LAUNCHER_PID), str(os.getpid())
    from modules.util.out_of_memory import killed_rank_message, start_record
    memory_record = start_record()   # a rank SIGKILLed by the OOM killer is said as such
    # the launcher installs its own handlers for these and leaves them: a caller that goes on (the tests, a
    # queue) must get its Ctrl-C back
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    previous_handlers = ({sig: signal.getsignal(sig) for sig in handled}
                         if threading.current_thread() is threading.main_thread() else {})
    try:
        elastic_launch(launch, entrypoint=sys.executable)(script, *argv)
    except ChildFailedError as error:
        rank, first = min(error.failures.items(), key=lambda item: item[1].timestamp)  # {global rank: failure}
        print(killed_rank_message(rank, first.exitcode, memory_record), file=sys.stderr)
        return 2 if first.exitcode == 2 else 1   # a configuration error a rank found (a workspace in use) stays one
    except SignalException as signal_received:
        # Ctrl-C: the launcher passed the signal on; the ranks stop after their step and rank 0 writes a backup,
        # within the 30 s the launcher grants before it kills them
        print(f"train: stopped by {signal_received.sigval.name}", file=sys.stderr)
        return 1
    finally:
        for sig, handler in previous_handlers.items():
            if handler is not None:   # None: installed outside Python, cannot be put back from here
                signal.signal(sig, handler)
        if previous_pid is None:
            os.environ.pop(LAUNCHER_PID, None)
        else:
            os.environ[LAUNCHER_PID] = previous_pid
    return 0


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
