"""Issue 13: several processes (gloo on the CPU, 2 ranks) train exactly as one process on the global batch: DDP
for LoRA, FSDP2 for a full fine-tune; caching is split across ranks; backups resume on another world size; a
failing rank stops every rank."""
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import shutil

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from learning import train
from modules.trainer.backup_io import read_backup
from modules.util.config.TrainConfig import TrainConfig

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


@pytest.fixture(scope="module")
def lora_runs(tiny_model, squares_dataset, tmp_path_factory):
    """The same LoRA training as 1 process x batch 2 and as 2 ranks x batch 1, each with a backup at BACKUP_AT."""
    base = tiny_model("wan2.1-t2v")
    tmp = tmp_path_factory.mktemp("lora")
    single = train(tmp / "single", base, squares_dataset, steps=STEPS, overrides=COMMON + ["batch_size=2"])
    ranks = run_ranks(tmp / "ranks", base, squares_dataset, COMMON + ["batch_size=1"])
    return {"tmp": tmp, "base": base, "single": single, "ranks": ranks}


def test_ddp_lora_equals_single_process_on_the_global_batch(lora_runs):
    single, ranks, tmp = lora_runs["single"], lora_runs["ranks"], lora_runs["tmp"]
    assert len(single.step_losses) == STEPS
    # every rank reports the global batch's loss
    assert ranks[0]["losses"] == pytest.approx(single.step_losses, abs=1e-5)
    assert ranks[1]["losses"] == pytest.approx(ranks[0]["losses"], abs=1e-12)
    # rank 0 alone saved, in the usual format, the same adapter
    assert_same_tensors(tmp / "ranks" / "out.safetensors", tmp / "single" / "out.safetensors", atol=1e-5)
    # and alone wrote the backups, with every rank's RNG and the layout
    backup = next((tmp / "ranks" / "run" / "backup").glob(f"*/step-{BACKUP_AT:08d}"))
    assert json.loads((backup / "ranks.json").read_text()) == {"world_size": 2, "batch_size": 1}


@pytest.fixture(scope="module")
def sharded_runs(lora_runs, squares_dataset):
    """In one pair of processes: the LoRA training of lora_runs on 2 ranks over a sharded base (with the counted
    step of planned_trace), then the single process's backup resumed there with the shards offloaded."""
    tmp = lora_runs["tmp"]
    cache = f"cache_dir={tmp / 'single' / 'cache'}"  # filled: the ranks go straight to training
    run = copy_backup(tmp / "single" / "run", tmp / "one_to_sharded")   # another output: the resume names the run
    (tmp / "one_to_sharded" / "results").mkdir(parents=True)
    # shard_base auto shards where the shards are offloaded to the host (FSDP2's CPU offload policy)
    resume = {"tmp": str(tmp / "one_to_sharded"), "results": str(tmp / "one_to_sharded" / "results"),
              "overrides": COMMON + ["batch_size=1", "backup.continue_last_backup=true", "distributed.cpu_offload=true",
                                     f"run_name={run}", cache]}
    ranks = run_ranks(tmp / "sharded", lora_runs["base"], squares_dataset,
                      COMMON + ["batch_size=1", "distributed.shard_base=true", cache],
                      trace=planned_trace(lora_runs["base"]), then=[resume])
    return {"ranks": ranks, "resumed": [json.loads((tmp / "one_to_sharded" / "results" / f"rank{r}.json").read_text())
                                        for r in range(2)]}


def test_lora_over_a_sharded_base_equals_single_process_on_the_global_batch(lora_runs, sharded_runs):
    single, tmp, ranks = lora_runs["single"], lora_runs["tmp"], sharded_runs["ranks"]
    assert ranks[0]["losses"] == pytest.approx(single.step_losses, abs=1e-6)
    assert ranks[1]["losses"] == pytest.approx(ranks[0]["losses"], abs=1e-12)
    # rank 0 alone saved one file: the adapter a single process trains
    assert_same_tensors(tmp / "sharded" / "out.safetensors", tmp / "single" / "out.safetensors", atol=1e-5)
    # each rank holds about half of the frozen base, the two halves the whole of it
    (held_0, whole), (held_1, _) = ranks[0]["base_bytes"], ranks[1]["base_bytes"]
    assert 0.45 < held_0 / whole < 0.55 and 0.45 < held_1 / whole < 0.55, (held_0, held_1, whole)
    assert held_0 + held_1 >= whole
    # whereas DDP holds all of it on every rank
    assert lora_runs["ranks"][0]["base_bytes"][0] == whole
    # the backup gathered the adapters and their optimizer state whole: the single process's backup
    sharded, one = (read_backup(next((tmp / name / "run" / "backup").glob(f"*/step-{BACKUP_AT:08d}")))
                    for name in ("sharded", "single"))
    assert sharded["trainable"].keys() == one["trainable"].keys()
    for key in one["trainable"]:
        torch.testing.assert_close(sharded["trainable"][key], one["trainable"][key], atol=1e-5, rtol=0, msg=key)
    assert sharded["optimizer"]["state"].keys() == one["optimizer"]["state"].keys()
    for position, entries in one["optimizer"]["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(sharded["optimizer"]["state"][position][key], value, atol=1e-5, rtol=1e-4)


def test_the_per_gpu_plan_of_a_sharded_base_is_the_counted_per_rank_peak(sharded_runs, lora_runs):
    """The planner's per-GPU prediction (fake tensors, one process) against the counted peak of the same step run
    for real on each of 2 ranks over a sharded base (in the processes of sharded_runs)."""
    from modules.planner.parallel_plan import TOLERANCE, plan_layouts
    from modules.planner.plan_shapes import PlanShape, resolve_architecture
    trace = planned_trace(lora_runs["base"])
    config = TrainConfig(**trace["config"])
    arch = resolve_architecture(config)
    arch = dataclasses.replace(arch, transformer={**arch.transformer, "num_layers": trace["layers"]})
    plans = {p.layout: p for p in plan_layouts(config, 2, arch=arch, shape=PlanShape(**trace["shape"]))}
    counted = [rank["traced_peak"] for rank in sharded_runs["ranks"]]
    for peak in counted:
        assert abs(plans["sharded base"].traced_bytes - peak) <= TOLERANCE * peak, (plans["sharded base"], counted)
    # and the sharded base is planned below the whole base on each GPU
    assert plans["sharded base"].traced_bytes < plans["DDP"].traced_bytes


def test_train_start_plans_per_gpu_and_auto_fit_picks_the_layout(tiny_model, monkeypatch, tmp_path):
    """Under torchrun (WORLD_SIZE 2) the check before loading plans each GPU: a card between the sharded base's and
    DDP's per-GPU peaks refuses DDP naming the layout that fits, and performance.auto_fit switches to it."""
    from modules.planner.parallel_plan import plan_layouts
    from modules.planner.plan_command import RunDoesNotFit, check_fits_device
    monkeypatch.setenv("WORLD_SIZE", "2")
    # the planner reads the transformer's config only: 6 blocks, as planned_trace's real step has
    folder = tmp_path / "six-blocks"
    shutil.copytree(tiny_model("wan2.1-t2v"), folder)
    transformer_config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**transformer_config, "num_layers": 6}))
    values = planned_trace(folder)["config"]
    config = TrainConfig(**{**values, "distributed": {"shard_base": False},
                            "data": {"resolution": 64, "frame_buckets": [9], "aspect_ratios": [1.0]}})
    plans = {p.layout: p for p in plan_layouts(config, 2)}
    card = (plans["DDP"].peak_bytes + plans["sharded base"].peak_bytes) / 2 / GIB
    with pytest.raises(RunDoesNotFit, match="fits: sharded base"):
        check_fits_device(config, "cpu", vram_gib=card, out=lambda _line: None)
    config.performance.auto_fit = card
    lines = []
    check_fits_device(config, "cpu", out=lines.append)
    assert config.distributed.shard_base is True and config.distributed.cpu_offload is False
    assert lines == [f"memory plan (2 GPUs, sharded base): predicted peak per GPU: "
                     f"{plans['sharded base'].peak_gib:.1f} GiB ({card:.1f} GiB, performance.auto_fit)"]


def test_gui_memory_line_answers_per_gpu(tiny_model):
    """The training tab's memory line (controller, no toolkit) for a multi_gpu config: the per-GPU answer of the
    layout the config asks for."""
    from modules.planner.parallel_plan import plan_layouts
    from modules.ui.MemoryPlanController import MemoryPlanController
    from modules.ui.UIState import UIState
    values = {**planned_trace(tiny_model("wan2.1-t2v"))["config"], "multi_gpu": True,
              "distributed": {"processes": 2, "shard_base": True},
              "data": {"resolution": 64, "frame_buckets": [9], "aspect_ratios": [1.0]}}
    controller = MemoryPlanController(UIState(values))
    assert controller.predict(4.0)
    controller.wait(120)
    expected = {p.layout: p for p in plan_layouts(TrainConfig(**values), 2)}["sharded base"]
    assert controller.poll() == (f"2 GPUs, sharded base: fits 4 GiB per GPU: {expected.peak_gib:.1f} GiB predicted "
                                 f"per GPU")


def planned_trace(base) -> dict:
    """6 blocks, so that one or two gathered blocks are a small part of the base, as at real size."""
    return {"config": {"model": {"base_model_name": str(base)}, "train_dtype": "BFLOAT_16", "device": "cpu",
                       "optimizer": {"optimizer": "ADAMW"}, "lora": {"rank": 4, "alpha": 4.0},
                       "gradient_checkpointing": False, "distributed": {"shard_base": True}},
            "layers": 6, "shape": {"batch_size": 1, "frames": 9, "height": 64, "width": 64}}


def test_one_process_backup_resumes_on_a_sharded_base(lora_runs, sharded_runs):
    tmp, single = lora_runs["tmp"], lora_runs["single"]
    assert sharded_runs["resumed"][0]["losses"] == pytest.approx(single.step_losses[BACKUP_AT:], abs=1e-6)
    assert_same_tensors(tmp / "one_to_sharded" / "out.safetensors", tmp / "single" / "out.safetensors", atol=1e-5)


def test_caching_is_split_across_ranks(lora_runs):
    single, ranks, tmp = lora_runs["single"], lora_runs["ranks"], lora_runs["tmp"]
    calls = [r["encode_calls"] for r in ranks]
    entries = [p for p in (tmp / "ranks" / "cache").rglob("*.safetensors")]
    # one process on an empty cache encodes every latent and text entry once: 24 clips + 6 captions
    assert single.data.encode_calls() == 30
    # two ranks: the union is complete, nothing is encoded twice, each encodes about half
    assert sum(calls) == len(entries) == 30
    assert all(12 <= c <= 18 for c in calls), calls


def copy_backup(source_workspace: Path, target: Path) -> str:
    """Copies the run's backup into another workspace; returns the run's name (the copy writes another output, so
    its resume names the run)."""
    backup = next((source_workspace / "backup").glob(f"*/step-{BACKUP_AT:08d}"))
    shutil.copytree(backup, target / "run" / "backup" / backup.parent.name / backup.name)
    return backup.parent.name


def test_two_rank_backup_resumes_on_one_process(lora_runs, squares_dataset):
    tmp, single = lora_runs["tmp"], lora_runs["single"]
    run = copy_backup(tmp / "ranks" / "run", tmp / "two_to_one")
    # the user's per-rank batch_size=1 stays as written: the resume keeps the backup's global batch of 2
    resumed = train(tmp / "two_to_one", lora_runs["base"], squares_dataset, steps=STEPS,
                    overrides=COMMON + ["batch_size=1", "backup.continue_last_backup=true", f"run_name={run}"])
    assert resumed.config.batch_size == 2
    assert resumed.step_losses == pytest.approx(single.step_losses[BACKUP_AT:], abs=1e-5)
    assert_same_tensors(tmp / "two_to_one" / "out.safetensors", tmp / "single" / "out.safetensors", atol=1e-5)


def test_one_process_backup_resumes_on_two_ranks(lora_runs, squares_dataset):
    tmp, single = lora_runs["tmp"], lora_runs["single"]
    run = copy_backup(tmp / "single" / "run", tmp / "one_to_two")
    ranks = run_ranks(tmp / "one_to_two", lora_runs["base"], squares_dataset,
                      COMMON + ["batch_size=2", "backup.continue_last_backup=true", f"run_name={run}"])
    assert ranks[0]["losses"] == pytest.approx(single.step_losses[BACKUP_AT:], abs=1e-5)
    assert_same_tensors(tmp / "one_to_two" / "out.safetensors", tmp / "single" / "out.safetensors", atol=1e-5)


def test_fsdp2_fine_tune_through_multi_gpu_equals_single_process(tiny_model, squares_dataset, tmp_path):
    base = tiny_model("wan2.1-t2v")
    overrides = ["optimizer.learning_rate=0.0001", "data.concepts.0.seed=3", f"backup.every_n_steps={BACKUP_AT}"]
    single = train(tmp_path / "single", base, squares_dataset, method="FINE_TUNE", steps=STEPS,
                   overrides=overrides + ["batch_size=2"])
    # the user's way: one command with multi_gpu, re-launched through torchrun's launcher as 2 CPU processes
    workspace = tmp_path / "ranks"
    command = [sys.executable, str(ROOT / "scripts" / "train.py")] + cli_arguments(
        base, squares_dataset, workspace, tmp_path / "single" / "cache",
        ["training_method=FINE_TUNE", "output.format=ORIGINAL", "batch_size=1", f"max_steps={STEPS}",
         "tensorboard=true", "multi_gpu=true", "distributed.processes=2", *overrides])
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stdout + done.stderr
    logs = list((workspace / "run" / "tensorboard").iterdir())
    assert len(logs) == 1, logs  # one run name for every rank, and rank 0 alone writes
    events = EventAccumulator(str(logs[0]))
    events.Reload()
    losses = [event.value for event in events.Scalars("loss/step")]
    assert losses == pytest.approx(single.step_losses, abs=1e-5)
    assert_same_tensors(workspace / "out.safetensors", tmp_path / "single" / "out.safetensors", atol=1e-5)
    # the sharded weights were gathered for the backup: it holds the whole trained transformer, as one process's
    backup = load_file(str(next((workspace / "run" / "backup").glob(f"*/step-{BACKUP_AT:08d}"))
                           / "trainable.safetensors"))
    assert backup.keys() == single.setup.trainable_state_dict().keys()


def test_a_failing_rank_stops_every_rank(lora_runs, squares_dataset, tmp_path):
    # the filled cache of the runs above: the ranks reach training quickly
    cache = lora_runs["tmp"] / "single" / "cache"
    argv = cli_arguments(lora_runs["base"], squares_dataset, tmp_path, cache, ["max_steps=1000", "batch_size=1"])
    processes = start_ranks({"argv": argv, "fail_rank": 1}, tmp_path)
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 240
    while len(ended) < 2 and time.monotonic() < deadline:
        for rank, process in enumerate(processes):
            if rank not in ended and process.poll() is not None:
                ended[rank] = time.monotonic()
        time.sleep(0.2)
    for process in processes:
        if process.poll() is None:
            process.kill()
    outputs = [p.communicate()[0] for p in processes]
    assert len(ended) == 2, f"a rank hung:\n{outputs}"
    assert all(p.returncode != 0 for p in processes), outputs
    assert "train: rank 1 of 2 stopped: injected failure on this rank" in outputs[1]
    assert "train: rank 0 of 2 stopped" in outputs[0], outputs[0]
    assert ended[0] - ended[1] < 60


def test_multi_process_settings_that_cannot_work_stop_before_loading(tiny_model, squares_dataset, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script
    common = cli_arguments(tiny_model("wan2.1-t2v"), squares_dataset, tmp_path, tmp_path / "cache",
                           ["training_method=FINE_TUNE", "output.format=ORIGINAL"])
    # no GPU here: multi_gpu needs distributed.processes
    assert train_script.main(common + ["--config-value", "multi_gpu=true"]) == 2
    assert "multi_gpu: no GPU is visible; set distributed.processes" in capsys.readouterr().err
    # a sharded fine-tune: EMA, block swap and previews are refused together
    samples = tmp_path / "samples.json"
    samples.write_text('[{"prompt": "a red square"}]')
    code = train_script.main(common + [argument for value in (
        "multi_gpu=true", "distributed.processes=2", "optimizer.ema=true", "performance.block_swap=1",
        f"sampling.samples_file={samples}") for argument in ("--config-value", value)])
    err = capsys.readouterr().err
    assert code == 2
    assert "optimizer.ema: not supported" in err and "performance.block_swap:" in err
    assert "sampling.samples_file: previews during a sharded (FSDP2)" in err


def test_sharded_base_settings_that_cannot_work_stop_before_loading(tiny_model, squares_dataset, tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script
    samples = tmp_path / "samples.json"
    samples.write_text('[{"prompt": "a red square"}]')
    common = cli_arguments(tiny_model("wan2.1-t2v"), squares_dataset, tmp_path, tmp_path / "cache",
                           ["multi_gpu=true", "distributed.processes=2"])
    values = ["distributed.shard_base=true", "optimizer.ema=true", "performance.block_swap=1",
              f"sampling.samples_file={samples}"]
    assert train_script.main(common + [a for v in values for a in ("--config-value", v)]) == 2
    err = capsys.readouterr().err
    for field in ("optimizer.ema", "performance.block_swap", "sampling.samples_file"):
        assert f"{field}: " in err and "multi-GPU run (distributed.shard_base)" in err, err
    # offloading shards where every GPU holds the whole base
    values = ["distributed.shard_base=false", "distributed.cpu_offload=true"]
    assert train_script.main(common + [a for v in values for a in ("--config-value", v)]) == 2
    assert "distributed.cpu_offload: offloads the shards of a sharded run" in capsys.readouterr().err
