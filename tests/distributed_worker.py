"""One rank of a multi-process training run for tests/test_multi_gpu.py, started with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT): `python tests/distributed_worker.py SPEC.json`.

SPEC: {"tmp", "base", "dataset", "method", "steps", "overrides", "results"} runs tests/learning.py's `train` and
writes results/rank<R>.json (per-step losses, encode calls, [step, validation loss] pairs, and the bytes of the frozen
base this rank holds against the whole base's; with a "trace" entry also "traced_peak", see traced_peak; "then":
more runs in the same processes);
{"argv", "fail_rank"} runs scripts/train.py with `argv`, rank `fail_rank` raising in its second batch."""
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "scripts")]
os.environ["HF_HUB_OFFLINE"] = "1"


def run_training(spec: dict) -> int:
    import torch
    torch.set_num_threads(1)
    # "then": further runs {"tmp", "overrides", "results"} in the same processes (starting two more costs more
    # than a tiny run), as is "trace"
    for run in [spec, *spec.get("then", [])]:
        result = train_once(spec, run)
        if "trace" in run:
            result["traced_peak"] = traced_peak(run["trace"])
        Path(run["results"], f"rank{os.environ['RANK']}.json").write_text(json.dumps(result))
    from modules.trainer.distributed import leave_process_group
    leave_process_group()
    return 0


def train_once(spec: dict, run: dict) -> dict:
    from learning import train
    trainer = train(Path(run["tmp"]), spec["base"], spec["dataset"], method=spec["method"], steps=spec["steps"],
                    overrides=run["overrides"])
    return {"losses": trainer.step_losses, "encode_calls": trainer.data.encode_calls(),
            "validation": [[r.step, r.loss] for r in trainer.validation.history] if trainer.validation else [],
            "base_bytes": base_bytes(trainer.model.transformer)}


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
    if int(os.environ["RANK"]) == spec["fail_rank"]:
        original, calls = BaseWanSetup.calculate_loss, []

        def failing(self, batch, prediction):
            calls.append(1)
            if len(calls) == 2:
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


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    sys.exit(run_failing(spec) if "argv" in spec else run_training(spec))
