"""One rank of a multi-process training run for tests/test_multi_gpu.py, started with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): `python tests/distributed_worker.py SPEC.json`.

SPEC: {"tmp", "base", "dataset", "method", "steps", "overrides", "results"} runs tests/learning.py's `train` and
writes results/rank<R>.json (per-step losses, encode calls, [step, validation loss] pairs, and the bytes of the frozen
base this rank holds against the whole base's; with a "trace" entry also "traced_peak", see traced_peak; "then":
more runs in the same processes, one with "resume_from" (a workspace) resuming its backup, each with its own "steps"
if given, and with "record_previews" writing every preview's latents (the sampler's output, before the lossy video)
to results/previews_rank<R>.safetensors; with "context_check": a folder, also context_parallel_check's tensors);
{"argv", "fail_rank"} runs scripts/train.py with `argv`, rank `fail_rank` raising in its second batch (with
"kill_at": N, killing itself with SIGKILL in its N-th batch); without "fail_rank" it just trains."""
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]
os.environ["HF_HUB_OFFLINE"] = "1"


def run_training(spec: dict) -> int:
    import torch
    torch.set_num_threads(1)
    if spec.get("unshared_host"):   # the layout before the ranks shared one host copy: each keeps its own
        import modules.trainer.shared_host as shared_host
        shared_host.share_on_machine = lambda tensors, tag, device: tensors
    # "then": further runs {"tmp", "overrides", "results", "base"?} in the same processes (starting two more costs more
    # than a tiny run), as is "trace"
    for run in [spec, *spec.get("then", [])]:
        result = train_once(spec, run)
        if "trace" in run:
            result["traced_peak"] = traced_peak(run["trace"])
        Path(run["results"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    if "context_check" in spec:
        context_parallel_check(spec["base"], Path(spec["context_check"]))
    from modules.trainer.distributed import leave_process_group
    leave_process_group()
    return 0


def train_once(spec: dict, run: dict) -> dict:
    from learning import train
    overrides = list(run["overrides"])
    if "resume_from" in run:   # a workspace of an earlier run: its backup of step BACKUP_AT, copied by rank 0
        from multi_gpu_runs import BACKUP_AT
        import shutil
        backup = next(Path(run["resume_from"], "backup").glob(f"*/step-{BACKUP_AT:08d}"))
        if os.environ["RANK"] == "0":   # the trainer's first barrier keeps the other ranks from reading it earlier
            shutil.copytree(backup, Path(run["tmp"], "run", "backup", backup.parent.name, backup.name))
        overrides += ["backup.continue_last_backup=true", f"run_name={backup.parent.name}"]
    with recorded_previews(Path(run["results"]) if run.get("record_previews") else None):
        trainer = train(Path(run["tmp"]), run.get("base", spec["base"]), spec["dataset"], method=spec["method"],
                        steps=run.get("steps", spec["steps"]), overrides=overrides)
    result = {"losses": trainer.step_losses, "encode_calls": trainer.data.encode_calls(),
            "validation": [[r.step, r.loss] for r in trainer.validation.history] if trainer.validation else [],
            "base_bytes": base_bytes(trainer.model.transformer), "layout": trainer.parallel.layout,
            "own_expert": trainer.parallel.own_expert}
    if trainer.parallel.context_parallel > 1:
        result["block_tokens"] = block_tokens(trainer)
    swap = getattr(trainer.setup, "performance", {}).get("transformer")
    if swap is not None and swap.block_swap is not None:
        result["swapped_host"] = swapped_host_mappings(swap.block_swap)
    return result


def swapped_host_mappings(swap) -> list:
    """[path, device, inode] of the /proc/self/maps region each swapped host weight lies in (["anonymous"] for
    memory of this process's own)."""
    regions = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        regions.append((start, end, fields[3], int(fields[4]), fields[5] if len(fields) > 5 else ""))
    found = []
    for pairs in swap.host.values():
        for _, host in pairs:
            pointer = host.data_ptr()
            region = next(r for r in regions if r[0] <= pointer < r[1])
            found.append([region[4], region[2], region[3]] if region[3] else ["anonymous"])
    return found


@contextlib.contextmanager
def recorded_previews(results: Path | None):
    """Every latent video this rank's sampler returns, in order, written to results/previews_rank<R>.safetensors
    (None: nothing recorded). The sampler runs unchanged; only its results are kept."""
    if results is None:
        yield
        return
    from safetensors.torch import save_file

    from modules.modelSampler.WanModelSampler import WanModelSampler
    original, latents = WanModelSampler.sample, []

    def recording(self, sample, on_step=None):
        result = original(self, sample, on_step)
        latents.append(result.latents.contiguous())
        return result

    WanModelSampler.sample = recording
    try:
        yield
    finally:
        WanModelSampler.sample = original
    save_file({str(index): tensor for index, tensor in enumerate(latents)},
              str(results / f"previews_rank{os.environ['RANK']}.safetensors"))


def block_tokens(trainer) -> list[int]:
    """The tokens this rank's blocks compute of one training batch (all ranks of a context-parallel group run it)."""
    import torch
    seen = []
    # the self-attention's query projection: diffusers splits the tokens in the block's own forward, after its
    # pre-hooks, and the token-chunked block (performance.chunk_tokens) calls the projections, not attn1 itself
    handle = trainer.model.transformer.blocks[0].attn1.to_q.register_forward_pre_hook(
        lambda _module, args: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            trainer.setup.predict(next(iter(trainer.data.batches(0))), torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    return seen


def base_bytes(transformer) -> list[int]:
    """[bytes of the frozen weights' storages this rank holds, bytes of the whole frozen weights]: a shard counts
    with its storage (padding included), each storage once."""
    from torch.distributed.tensor import DTensor
    held, whole, seen = 0, 0, set()
    for parameter in transformer.parameters():
        if parameter.requires_grad:
            continue
        whole += parameter.numel() * parameter.element_size()
        storage = (parameter.to_local() if isinstance(parameter, DTensor) else parameter).untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            held += storage.nbytes()
    return [held, whole]


def run_failing(spec: dict) -> int:
    import torch
    torch.set_num_threads(1)
    from modules.modelSetup.BaseWanSetup import BaseWanSetup
    if int(os.environ["RANK"]) == spec.get("fail_rank", -1):
        original, calls = BaseWanSetup.calculate_loss, []

        def failing(self, batch, prediction):
            calls.append(1)
            if len(calls) == spec.get("kill_at", 2):
                if "kill_at" in spec:   # as a lost machine or the OOM killer ends a process: no word, no cleanup
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError("injected failure on this rank")
            return original(self, batch, prediction)

        BaseWanSetup.calculate_loss = failing
    import train as train_script
    return train_script.main(spec["argv"])


def traced_peak(trace: dict) -> int:
    """The counted peak of one real step of the LoRA over a sharded base (the planner's step_trace on real tensors,
    placed by ParallelLayout) for trace = {"config": values, "layers", "shape"}."""
    import dataclasses

    import torch
    from modules.planner.plan_shapes import PlanShape, resolve_architecture
    from modules.planner.step_trace import trace_step
    from modules.trainer.distributed import join_process_group
    from modules.trainer.ParallelLayout import Parallel
    from modules.util.config.TrainConfig import TrainConfig
    config = TrainConfig(**trace["config"])
    device = join_process_group(config)
    arch = resolve_architecture(config)
    arch = dataclasses.replace(arch, transformer={**arch.transformer, "num_layers": trace["layers"]})
    parallel = Parallel(config)
    torch.manual_seed(0)
    counter, _ = trace_step(config, arch, PlanShape(**trace["shape"]), fake=False,
                            place=lambda setup, model: parallel.wrap(setup, model, device))
    return counter.peak


def context_inputs(base) -> tuple:
    """The tiny model's transformer in float32 (every weight trains) and one fixed input: 12 tokens (3 latent frames x
    2 x 2 patches), 2 heads, and a fixed weighting of the output that the loss sums over."""
    import torch
    from diffusers import WanTransformer3DModel
    transformer = WanTransformer3DModel.from_pretrained(Path(base) / "transformer", torch_dtype=torch.float32)
    transformer.requires_grad_(True)
    generator = torch.Generator().manual_seed(7)
    inputs = {"hidden_states": torch.randn(1, transformer.config.in_channels, 3, 4, 4, generator=generator),
              "timestep": torch.tensor([613.0]),
              "encoder_hidden_states": torch.randn(1, 6, transformer.config.text_dim, generator=generator)}
    weights = torch.randn(1, transformer.config.out_channels, 3, 4, 4, generator=generator)
    return transformer, inputs, weights


def context_parallel_check(base, folder: Path) -> None:
    """Forward and backward of the tiny transformer with its tokens split over this run's ranks (context
    parallel, as ParallelLayout wraps it: diffusers' hooks and DDP with the group-sum hook); writes the output and
    every gradient of this rank to folder/rank<R>.safetensors."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from modules.trainer import context_parallel
    world = torch.distributed.get_world_size()
    transformer, inputs, weights = context_inputs(base)
    mesh = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("dp", "ring", "ulysses"))
    context_parallel.enable(transformer, mesh, torch.device("cpu"))
    wrapped = DistributedDataParallel(transformer)
    wrapped.register_comm_hook(context_parallel.GroupSum(world), context_parallel.group_sum_hook)
    output = wrapped(**inputs, return_dict=False)[0]
    (output * weights).sum().backward()
    tensors = {"output": output.detach().contiguous()}
    tensors.update({f"grad.{name}": p.grad.contiguous() for name, p in transformer.named_parameters()})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / f"rank{os.environ['RANK']}.safetensors"))


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    sys.exit(run_failing(spec) if "argv" in spec else run_training(spec))
