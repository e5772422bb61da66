"""What the multi-process tests share (tests/test_multi_gpu.py, tests/test_multi_gpu_layouts.py): the settings of
the tiny LoRA runs, starting ranks with torchrun's environment (or two torchrun agents), and comparing their files."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from learning import train

GIB = 1024 ** 3

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "distributed_worker.py"
# 24 squares clips: 12 global batches of 2 an epoch; step 3 is mid-epoch, so a resume must find its data position
STEPS, BACKUP_AT = 5, 3
# lr 1e-4: in the first steps LoRA's A matrices get near-zero gradients, and Adam's g / sqrt(v) turns the float
# rounding of a batch of 2 versus two batches of 1 into relative changes of their updates; a small rate keeps that
# noise well under the 1e-5 the weights are compared at
COMMON = ["optimizer.learning_rate=0.0001", "data.concepts.0.seed=3", f"backup.every_n_steps={BACKUP_AT}",
          "backup.rolling_count=5"]
# the A14B runs: each expert's range is drawn alone, and expert parallel with one rank per expert is bit-identical to
# one process, so a rate that moves the adapters visibly (the preview test tells the experts' adapters apart)
EXPERT_VALUES = [value for value in COMMON if not value.startswith("optimizer.learning_rate")] + [
    "optimizer.learning_rate=0.01", "model_type=WAN_2_2", "data.validation_split=0.25",
    "validation.before_training=false"]   # the validation loss once, at the end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(spec: dict, folder: Path, world: int = 2) -> list[subprocess.Popen]:
    """`world` processes with the environment torchrun gives its workers."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    port = free_port()
    processes = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1")   # a crash shows where it happened
        processes.append(subprocess.Popen([sys.executable, str(WORKER), str(spec_path)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return processes


def run_ranks(tmp: Path, base, dataset, overrides, method="LORA", steps=STEPS, **extra) -> list[dict]:
    results = tmp / "results"
    results.mkdir(parents=True, exist_ok=True)
    spec = {"tmp": str(tmp), "base": str(base), "dataset": str(dataset), "method": method, "steps": steps,
            "overrides": overrides, "results": str(results), **extra}
    processes = start_ranks(spec, tmp)
    outputs = [p.communicate(timeout=300)[0] for p in processes]
    for process, output in zip(processes, outputs):
        assert process.returncode == 0, output
    return [json.loads((results / f"rank{r}.json").read_text()) for r in range(2)]


def assert_same_tensors(path_a: Path, path_b: Path, atol: float) -> None:
    a, b = load_file(str(path_a)), load_file(str(path_b))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], atol=atol, rtol=0, msg=key)


def cli_arguments(base, dataset, workspace: Path, cache: Path, values: list[str]) -> list[str]:
    """scripts/train.py arguments for the tiny model on the squares, as tests/learning.py's `train` sets them."""
    values = [f"model.base_model_name={base}", f"workspace_dir={workspace / 'run'}", f"cache_dir={cache}",
              f"output.destination={workspace / 'out.safetensors'}", "output.dtype=FLOAT_32", "device=cpu",
              "train_dtype=FLOAT_32", "gradient_checkpointing=false", "epochs=1000",
              f'data.concepts=[{{"path": "{dataset}"}}]', "data.frame_buckets=[9]", "data.resolution=32",
              "data.aspect_ratios=[1.0]", "data.dataloader_threads=0", "optimizer.weight_decay=0",
              "timestep.distribution=uniform", "tensorboard=false", *values]
    return [argument for value in values for argument in ("--config-value", value)]


def make_lora_runs(tiny_model, squares_dataset, tmp_path_factory) -> dict:
    """conftest's `lora_runs`: the same LoRA training as 1 process x batch 2 and as 2 ranks x batch 1, each with a
    backup at BACKUP_AT (the single process also with a preview at BACKUP_AT)."""
    base = tiny_model("wan2.1-t2v")
    tmp = tmp_path_factory.mktemp("lora")
    single = train(tmp / "single", base, squares_dataset, steps=STEPS,
                   overrides=COMMON + ["batch_size=2"] + preview_values(tmp))
    ranks = run_ranks(tmp / "ranks", base, squares_dataset, COMMON + ["batch_size=1"])
    return {"tmp": tmp, "base": base, "single": single, "ranks": ranks}


def planned_trace(base) -> dict:
    """6 blocks, so that one or two gathered blocks are a small part of the base, as at real size."""
    return {"config": {"model": {"base_model_name": str(base)}, "train_dtype": "BFLOAT_16", "device": "cpu",
                       "optimizer": {"optimizer": "ADAMW"}, "lora": {"rank": 4, "alpha": 4.0},
                       "gradient_checkpointing": False, "distributed": {"shard_base": True}},
            "layers": 6, "shape": {"batch_size": 1, "frames": 9, "height": 64, "width": 64}}


def copy_backup(source_workspace: Path, target: Path) -> str:
    """Copies the run's backup into another workspace; returns the run's name (the copy writes another output, so
    its resume names the run)."""
    backup = next((source_workspace / "backup").glob(f"*/step-{BACKUP_AT:08d}"))
    shutil.copytree(backup, target / "run" / "backup" / backup.parent.name / backup.name)
    return backup.parent.name


def preview_values(tmp: Path, at: int = BACKUP_AT) -> list[str]:
    """One small preview at step `at` (context_runs compares its own with the single process's; the A14B pair's
    boundary splits its 3 denoising steps between the experts)."""
    samples = tmp / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square", "width": 32, "height": 32, "frames": 9, "steps": 3,
                                    "seed": 5}]))
    return [f"sampling.samples_file={samples}", f"sampling.every_n_steps={at}"]


def preview_strip(workspace: Path):
    import numpy as np
    from PIL import Image
    return np.asarray(Image.open(next((workspace / "run" / "samples").glob(f"*/0-a-red-square/{BACKUP_AT}-*.png"))))


def start_agents(spec: dict, folder: Path) -> list[subprocess.Popen]:
    """Two torchrun agents on this machine as two machines would start them: --nnodes 2, one process each, one c10d
    rendezvous endpoint (the first agent to bind it hosts the store)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", f"wan-test-{folder.name}",
               "--max-restarts", "0", str(WORKER), str(spec_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for _ in range(2)]


def wait_for_all(processes: list[subprocess.Popen], limit: float = 240) -> tuple[dict[int, float], list[str]]:
    """({index: when it ended (monotonic)}, outputs) of processes expected to stop; any still running after `limit`
    seconds is killed and missing from the first."""
    ended: dict[int, float] = {}
    deadline = time.monotonic() + limit
    while len(ended) < len(processes) and time.monotonic() < deadline:
        for index, process in enumerate(processes):
            if index not in ended and process.poll() is not None:
                ended[index] = time.monotonic()
        time.sleep(0.2)
    for process in processes:
        if process.poll() is None:
            process.kill()
    return ended, [process.communicate()[0] for process in processes]
