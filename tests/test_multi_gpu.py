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

import shlex
import shutil

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from learning import train
from modules.trainer.backup_io import read_backup
from modules.trainer.GenericTrainer import step_seed
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
A14B_VALUES = ["expert=both", "model_type=WAN_2_2", "timestep.shift=12"]   # shift 12: both experts get steps


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
    single = train(tmp / "single", base, squares_dataset, steps=STEPS,
                   overrides=COMMON + ["batch_size=2"] + preview_values(tmp))
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


def preview_values(tmp: Path) -> list[str]:
    """One small preview at step BACKUP_AT (context_runs compares its own with the single process's)."""
    samples = tmp / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square", "width": 32, "height": 32, "frames": 9, "steps": 3,
                                    "seed": 5}]))
    return [f"sampling.samples_file={samples}", f"sampling.every_n_steps={BACKUP_AT}"]


def preview_strip(workspace: Path):
    import numpy as np
    from PIL import Image
    return np.asarray(Image.open(next((workspace / "run" / "samples").glob(f"*/0-a-red-square/{BACKUP_AT}-*.png"))))


@pytest.fixture(scope="module")
def context_runs(lora_runs, squares_dataset, tiny_model):
    """In one pair of processes: the LoRA training of lora_runs' single process (batch 2) on 1 data-parallel group x
    2 context-parallel ranks, then expert_runs' A14B training with one expert per rank, then the tiny transformer's
    forward and backward with its tokens split over both ranks."""
    tmp = lora_runs["tmp"]
    experts = tmp / "experts"
    a14b = tiny_model("wan2.2-t2v-a14b")
    single = train(experts / "single", a14b, squares_dataset, steps=STEPS,
                   overrides=COMMON + A14B_VALUES + ["batch_size=2"])
    (experts / "ranks" / "results").mkdir(parents=True)
    expert_run = {"tmp": str(experts / "ranks"), "results": str(experts / "ranks" / "results"), "base": str(a14b),
                  "overrides": COMMON + A14B_VALUES + ["batch_size=2", f"cache_dir={experts / 'single' / 'cache'}"]}
    ranks = run_ranks(tmp / "context", lora_runs["base"], squares_dataset,
                      COMMON + ["batch_size=2", "distributed.context_parallel=2", f"cache_dir={tmp / 'single' / 'cache'}",
                                *preview_values(tmp)],
                      context_check=str(tmp / "context" / "check"), then=[expert_run])
    return {"ranks": ranks, "check": tmp / "context" / "check",
            "experts": {"tmp": experts, "single": single,
                        "ranks": [json.loads((experts / "ranks" / "results" / f"rank{r}.json").read_text())
                                  for r in range(2)]}}


def test_context_parallel_forward_and_gradients_equal_one_process(lora_runs, context_runs):
    from distributed_worker import context_inputs
    transformer, inputs, weights = context_inputs(lora_runs["base"])
    assert transformer.config.num_attention_heads == 2
    output = transformer(**inputs, return_dict=False)[0]
    (output * weights).sum().backward()
    for rank in range(2):
        split = load_file(str(context_runs["check"] / f"rank{rank}.safetensors"))
        torch.testing.assert_close(split["output"], output.detach(), atol=1e-5, rtol=0)
        for name, parameter in transformer.named_parameters():
            torch.testing.assert_close(split[f"grad.{name}"], parameter.grad, atol=1e-5, rtol=0, msg=name)


def test_lora_with_context_parallel_equals_single_process(lora_runs, context_runs):
    """dp 1 x cp 2: both ranks take the whole global batch of 2 and each holds half of its tokens."""
    single, tmp, ranks = lora_runs["single"], lora_runs["tmp"], context_runs["ranks"]
    assert ranks[0]["losses"] == pytest.approx(single.step_losses, abs=1e-6)
    assert ranks[1]["losses"] == pytest.approx(ranks[0]["losses"], abs=1e-12)
    # each rank's blocks computed half of the batch's tokens: 9x32x32 clips are 3 latent frames x 2 x 2 patches
    assert [rank["block_tokens"] for rank in ranks] == [[6], [6]]
    assert_same_tensors(tmp / "context" / "out.safetensors", tmp / "single" / "out.safetensors", atol=1e-5)
    backup = next((tmp / "context" / "run" / "backup").glob(f"*/step-{BACKUP_AT:08d}"))
    assert json.loads((backup / "ranks.json").read_text()) == {"world_size": 1, "batch_size": 2}
    # the preview, computed by both ranks with the tokens split and written by rank 0, is the single process's
    single_strip, strip = preview_strip(tmp / "single"), preview_strip(tmp / "context")
    assert strip.shape == single_strip.shape
    assert abs(strip.astype(int) - single_strip.astype(int)).max() <= 1


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


def test_context_parallel_that_cannot_divide_stops_before_loading(tiny_model, squares_dataset, tmp_path, capsys):
    """The tiny model has 2 heads; a 1x32x32 image is 1 latent frame x 2 x 2 = 4 tokens: 3 GPUs split neither,
    and 3 does not divide 4 processes. All three are said at once, before any model loads."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script
    common = cli_arguments(tiny_model("wan2.1-t2v"), squares_dataset, tmp_path, tmp_path / "cache",
                           ["multi_gpu=true", "distributed.processes=4", "distributed.context_parallel=3",
                            "data.frame_buckets=[1, 9]"])
    assert train_script.main(common) == 2
    err = capsys.readouterr().err
    assert "distributed.context_parallel: 3 does not divide the 4 processes" in err
    assert "the model's 2 attention heads do not divide over 3 GPUs" in err
    assert "the tokens (latent frames x height/16 x width/16) of 1x32x32 (4) do not divide over 3 GPUs" in err
    assert not (tmp_path / "cache").exists()


def test_auto_fit_chooses_context_parallel_when_only_split_tokens_fit(tiny_model, monkeypatch):
    """2 GPUs: every layout is listed per GPU, and a card that holds the run only with half of each clip's tokens
    per GPU (not with the whole or a sharded base) makes performance.auto_fit choose context parallel 2."""
    from modules.planner.parallel_plan import plan_layouts, report
    from modules.planner.plan_command import check_fits_device
    monkeypatch.setenv("WORLD_SIZE", "2")
    values = {**planned_trace(tiny_model("wan2.1-t2v"))["config"], "distributed": {"shard_base": "auto"},
              "data": {"resolution": 128, "frame_buckets": [17], "aspect_ratios": [1.0]}}
    plans = {p.layout: p for p in plan_layouts(TrainConfig(**values), 2)}
    assert {"DDP", "sharded base", "sharded base + CPU offload", "context parallel 2"} <= plans.keys()
    split, whole = plans["context parallel 2"], plans["DDP"]
    assert split.built and not split.problem and split.peak_bytes < plans["sharded base"].peak_bytes
    card = (split.peak_bytes + min(plans["sharded base"].peak_bytes, whole.peak_bytes)) / 2 / GIB
    assert "context parallel 2" in report(list(plans.values()), split, card)
    config = TrainConfig(**values)
    config.performance.auto_fit = card
    lines = []
    check_fits_device(config, "cpu", out=lines.append)
    assert config.distributed.context_parallel == 2 and config.distributed.shard_base is False
    assert lines[0].startswith("memory plan (2 GPUs, context parallel 2): predicted peak per GPU")



@pytest.fixture(scope="module")
def expert_runs(context_runs):
    """A14B `both` LoRA training in one process (batch 2) and expert parallel on 2 ranks (in context_runs'
    processes): rank 0 the high-noise expert, rank 1 the low-noise one, each taking the whole global batch of 2."""
    return context_runs["experts"]


def test_expert_parallel_both_experts_equal_single_process_both(expert_runs):
    single, ranks, tmp = expert_runs["single"], expert_runs["ranks"], expert_runs["tmp"]
    routed = {single.setup.step_expert(torch.Generator().manual_seed(step_seed(single.config.seed, step)))
              for step in range(STEPS)}
    assert routed == {"transformer", "transformer_2"}   # both experts trained in these steps
    assert [rank["own_expert"] for rank in ranks] == ["transformer", "transformer_2"]
    assert ranks[0]["layout"].startswith("expert parallel")
    assert ranks[0]["losses"] == pytest.approx(single.step_losses, abs=1e-6)
    assert ranks[1]["losses"] == pytest.approx(ranks[0]["losses"], abs=1e-12)
    for suffix in ("_high_noise", "_low_noise"):
        assert_same_tensors(tmp / "ranks" / f"out{suffix}.safetensors", tmp / "single" / f"out{suffix}.safetensors",
                            atol=1e-5)
    # the backup holds both experts' adapters and optimizer state, gathered from their ranks: the single process's
    parallel, one = (read_backup(next((tmp / name / "run" / "backup").glob(f"*/step-{BACKUP_AT:08d}")))
                     for name in ("ranks", "single"))
    assert parallel["trainable"].keys() == one["trainable"].keys()
    for key in one["trainable"]:
        torch.testing.assert_close(parallel["trainable"][key], one["trainable"][key], atol=1e-5, rtol=0, msg=key)
    assert parallel["optimizer"]["state"].keys() == one["optimizer"]["state"].keys()
    for position, entries in one["optimizer"]["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(parallel["optimizer"]["state"][position][key], value, atol=1e-5, rtol=1e-4)


def test_expert_parallel_is_planned_per_gpu_and_is_what_a14b_both_runs(tiny_model):
    """A14B `both` on 2 GPUs: each GPU holds one expert (half of both experts' weights), and the plan the trainer
    checks at the start is expert parallel unless distributed.expert_parallel is off."""
    from modules.planner.parallel_plan import configured, plan_layouts
    values = {**planned_trace(tiny_model("wan2.2-t2v-a14b"))["config"], "expert": "both",
              "distributed": {"shard_base": "auto"}, "data": {"resolution": 64, "frame_buckets": [9],
                                                              "aspect_ratios": [1.0]}}
    config = TrainConfig(**values)
    plans = {p.layout: p for p in plan_layouts(config, 2)}
    experts, whole = plans["expert parallel"], plans["DDP"]
    assert experts.built and not experts.problem and experts.peak_bytes < whole.peak_bytes
    assert configured(list(plans.values()), config, None) is experts
    assert experts.config_values()["distributed.expert_parallel"] is True
    assert whole.config_values() == {"distributed.expert_parallel": False, "distributed.shard_base": False}
    config.distributed.expert_parallel = False
    assert configured(list(plans.values()), config, None).layout == "DDP"


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


def test_two_node_rendezvous_a_killed_rank_stops_all_and_the_resume_is_bit_identical(lora_runs, squares_dataset,
                                                                                       tmp_path):
    """Rank 1 is killed (SIGKILL) in step 5, after the backup of step 3: both agents end within a minute, rank 1's
    agent names it, the surviving rank prints the command that resumes; that command, run on both agents, trains
    steps 4 and 5 and saves one file, bit for bit the file of the same 2-rank training never interrupted."""
    cache = lora_runs["tmp"] / "single" / "cache"
    argv = cli_arguments(lora_runs["base"], squares_dataset, tmp_path, cache,
                         COMMON + ["batch_size=1", f"max_steps={STEPS}", "output.format=COMFY_LORA"])
    agents = start_agents({"argv": argv, "fail_rank": 1, "kill_at": STEPS}, tmp_path / "killed")
    ended: dict[int, float] = {}
    deadline = time.monotonic() + 240
    while len(ended) < 2 and time.monotonic() < deadline:
        for index, agent in enumerate(agents):
            if index not in ended and agent.poll() is not None:
                ended[index] = time.monotonic()
        time.sleep(0.2)
    for agent in agents:
        if agent.poll() is None:
            agent.kill()
    outputs = [agent.communicate()[0] for agent in agents]
    assert len(ended) == 2, f"an agent hung:\n{outputs}"
    assert max(ended.values()) - min(ended.values()) < 60
    assert all(agent.returncode != 0 for agent in agents), outputs
    text = "\n".join(outputs)
    assert "rank      : 1 (local_rank: 0)" in text and "Signal 9 (SIGKILL)" in text, text
    assert "train: rank 0 of 2 stopped" in text, text
    command = text.split("the job stopped; to resume from the last backup", 1)[1].split("\n")[1].strip()
    resume = shlex.split(command.split(" && ", 1)[1])[2:]   # python scripts/train.py ARGS
    assert f"run_name=" in " ".join(resume) and "backup.continue_last_backup=true" in resume
    agents = start_agents({"argv": resume}, tmp_path / "resumed")
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert all(agent.returncode == 0 for agent in agents), outputs
    saved, uninterrupted = load_file(str(tmp_path / "out.safetensors")), \
        load_file(str(lora_runs["tmp"] / "ranks" / "out.safetensors"))
    assert saved.keys() == uninterrupted.keys()
    assert all(torch.equal(saved[key], uninterrupted[key]) for key in saved)
