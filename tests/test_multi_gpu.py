"""Issue 13: several processes (gloo on the CPU, 2 ranks) train exactly as one process on the global batch: DDP
for LoRA, FSDP2 for a full fine-tune; caching is split across ranks; backups resume on another world size; a
failing rank stops every rank."""
import dataclasses
import json
import os
import subprocess
import sys

import shutil

import pytest
import torch
from safetensors.torch import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from learning import train
from modules.trainer.backup_io import read_backup
from modules.util.config.TrainConfig import TrainConfig
from multi_gpu_runs import (BACKUP_AT, COMMON, GIB, ROOT, STEPS, assert_same_tensors, cli_arguments, copy_backup,
                            planned_trace, preview_strip, preview_values, run_ranks, start_ranks, wait_for_all)


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


# a short LoRA run over a sharded base that holds items out (3 validation batches of 2: a rank short of one runs a
# copy, as the sharded forward needs every rank) and previews at its last step, and its one-process counterpart
PREVIEW_STEPS = 2
PREVIEWED = [value for value in COMMON if not value.startswith("backup.")] + [
    "data.validation_split=0.25", "validation.batch_size=2"]


@pytest.fixture(scope="module")
def sharded_runs(lora_runs, squares_dataset):
    """In one pair of processes: the LoRA training of lora_runs on 2 ranks over a sharded base (with the counted
    step of planned_trace), then the single process's backup resumed there with the shards offloaded, then FLOAT_8
    weights, then the PREVIEWED run."""
    tmp = lora_runs["tmp"]
    cache = f"cache_dir={tmp / 'single' / 'cache'}"  # filled: the ranks go straight to training
    run = copy_backup(tmp / "single" / "run", tmp / "one_to_sharded")   # another output: the resume names the run
    (tmp / "one_to_sharded" / "results").mkdir(parents=True)
    # shard_base auto shards where the shards are offloaded to the host (FSDP2's CPU offload policy)
    resume = {"tmp": str(tmp / "one_to_sharded"), "results": str(tmp / "one_to_sharded" / "results"),
              "overrides": COMMON + ["batch_size=1", "backup.continue_last_backup=true", "distributed.cpu_offload=true",
                                     f"run_name={run}", cache]}
    # FLOAT_8 base weights over a sharded base, against one process with them (computed in bfloat16)
    fp8 = {"tmp": str(tmp / "fp8_sharded"), "results": str(tmp / "fp8_sharded" / "results"),
           "overrides": COMMON + FP8 + ["batch_size=1", "distributed.shard_base=true", cache]}
    (tmp / "fp8_sharded" / "results").mkdir(parents=True)
    (tmp / "previewed_sharded" / "results").mkdir(parents=True)
    previewed = {"tmp": str(tmp / "previewed_sharded"), "results": str(tmp / "previewed_sharded" / "results"),
                 "steps": PREVIEW_STEPS, "record_previews": True,
                 "overrides": PREVIEWED + preview_values(tmp / "previewed_sharded", at=PREVIEW_STEPS)
                 + ["batch_size=1", "distributed.shard_base=true", cache]}
    ranks = run_ranks(tmp / "sharded", lora_runs["base"], squares_dataset,
                      COMMON + ["batch_size=1", "distributed.shard_base=true", cache],
                      trace=planned_trace(lora_runs["base"]), then=[resume, fp8, previewed])
    return {"ranks": ranks, "resumed": [json.loads((tmp / "one_to_sharded" / "results" / f"rank{r}.json").read_text())
                                        for r in range(2)],
            "fp8": [json.loads((tmp / "fp8_sharded" / "results" / f"rank{r}.json").read_text()) for r in range(2)],
            "previewed": [json.loads((tmp / "previewed_sharded" / "results" / f"rank{r}.json").read_text())
                          for r in range(2)]}


def test_a_sharded_base_previews_and_validates_as_one_process(lora_runs, sharded_runs, squares_dataset):
    """Every rank runs the sampler in step over the sharded transformer (FSDP2 gathers each block from all ranks,
    as in training) and rank 0 writes the preview: the sampler's latents equal one process sampling the same
    weights (the run's saved LoRA at the previewed step) with the same seed. The validation loss, each rank
    evaluating its share of the batches, equals one process's."""
    import numpy as np
    from PIL import Image

    from modules.modelSampler.sampling_io import apply_lora_files, load_model_for_sampling
    from modules.modelSampler.TrainingSampler import frame_strip
    from modules.modelSampler.WanModelSampler import WanModelSampler
    from modules.util.enum.DataType import DataType
    from modules.util.sample_definitions import load_sample_definitions
    tmp, ranks = lora_runs["tmp"] / "previewed_sharded", sharded_runs["previewed"]
    assert ranks[0]["layout"] == "sharded base (FSDP2)" and len(ranks[0]["losses"]) == PREVIEW_STEPS
    # one preview, computed on both ranks alike
    latents = [load_file(str(tmp / "results" / f"previews_rank{r}.safetensors")) for r in range(2)]
    assert list(latents[0]) == ["0"] and list(latents[1]) == ["0"]
    assert torch.equal(latents[0]["0"], latents[1]["0"])
    model = load_model_for_sampling(str(lora_runs["base"]), DataType.FLOAT_32, torch.device("cpu"))
    apply_lora_files(model, [(tmp / "out.safetensors", 1.0)])
    sample = load_sample_definitions(str(tmp / "samples.json"))[0]
    alone = WanModelSampler(model, device=torch.device("cpu")).sample(sample)
    torch.testing.assert_close(latents[0]["0"], alone.latents, atol=1e-5, rtol=0)
    # the trained adapters took part: the base alone samples something else
    base = load_model_for_sampling(str(lora_runs["base"]), DataType.FLOAT_32, torch.device("cpu"))
    assert (WanModelSampler(base, device=torch.device("cpu")).sample(sample).latents - alone.latents).abs().max() > 1e-3
    # rank 0 wrote it, once: its frames are the one process's
    strips = list((tmp / "run" / "samples").glob(f"*/0-a-red-square/{PREVIEW_STEPS}-*.png"))
    assert len(strips) == 1, strips
    written = np.asarray(Image.open(strips[0])).astype(int)
    assert abs(written - frame_strip(alone.frames_uint8()).astype(int)).max() <= 1
    # the validation loss before training (the same weights as one process) and at the end
    single = train(lora_runs["tmp"] / "previewed_single", lora_runs["base"], squares_dataset, steps=PREVIEW_STEPS,
                   overrides=PREVIEWED + ["batch_size=2", f"cache_dir={lora_runs['tmp'] / 'single' / 'cache'}"])
    expected = [[result.step, result.loss] for result in single.validation.history]
    assert [step for step, _ in expected] == [0, PREVIEW_STEPS]
    assert ranks[0]["losses"] == pytest.approx(single.step_losses, abs=1e-6)
    for rank in ranks:
        assert [step for step, _ in rank["validation"]] == [0, PREVIEW_STEPS]
        assert [loss for _, loss in rank["validation"]] == pytest.approx([loss for _, loss in expected], abs=1e-6)


FP8 = ["model.transformer.weight_dtype=FLOAT_8", "train_dtype=BFLOAT_16"]


def test_float8_base_weights_shard_as_one_process_computes_them(lora_runs, sharded_runs, squares_dataset):
    """Each rank holds half of the float8 base (1 byte a weight), FSDP2 casts each block's shards to bfloat16 as it
    gathers them (diffusers' layerwise casting does the same cast per layer in one process)."""
    tmp = lora_runs["tmp"]
    single = train(tmp / "fp8_single", lora_runs["base"], squares_dataset, steps=STEPS,
                   overrides=COMMON + FP8 + ["batch_size=2", f"cache_dir={tmp / 'single' / 'cache'}"])
    ranks = sharded_runs["fp8"]
    # bfloat16 compute: the losses agree to its rounding (about 1e-3 of a loss of 2.6), and Adam turns the rounding
    # of near-zero gradients into update differences of up to the learning rate a step (docs/multi-gpu.md)
    assert ranks[0]["losses"] == pytest.approx(single.step_losses, abs=2e-3)
    assert_same_tensors(tmp / "fp8_sharded" / "out.safetensors", tmp / "fp8_single" / "out.safetensors",
                        atol=2 * 1e-4 * STEPS)
    # the ranks' frozen base is the one process's, float8 where it is there (the blocks' linear layers), and each
    # rank holds about half of it
    frozen = [p for p in single.model.transformer.parameters() if not p.requires_grad]
    assert sum(p.numel() for p in frozen if p.dtype == torch.float8_e4m3fn) > 0.9 * sum(
        p.numel() for p in single.model.transformer.blocks.parameters() if not p.requires_grad)
    (held_0, whole), (held_1, _) = ranks[0]["base_bytes"], ranks[1]["base_bytes"]
    assert whole == sum(p.numel() * p.element_size() for p in frozen)
    assert 0.45 < held_0 / whole < 0.55 and 0.45 < held_1 / whole < 0.55, (held_0, held_1, whole)


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
    overrides = ["optimizer.learning_rate=0.0001", "data.concepts.0.seed=3", f"backup.every_n_steps={BACKUP_AT}",
                 *preview_values(tmp_path)]
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
    # the preview at the backup's step, every rank sampling the sharded transformer in step and rank 0 writing: the
    # one process's frames (the weights agree to 1e-5)
    sharded, alone = preview_strip(workspace).astype(int), preview_strip(tmp_path / "single").astype(int)
    assert abs(sharded - alone).max() <= 1


def test_a_failing_rank_stops_every_rank(lora_runs, squares_dataset, tmp_path):
    # the filled cache of the runs above: the ranks reach training quickly
    cache = lora_runs["tmp"] / "single" / "cache"
    argv = cli_arguments(lora_runs["base"], squares_dataset, tmp_path, cache, ["max_steps=1000", "batch_size=1"])
    processes = start_ranks({"argv": argv, "fail_rank": 1}, tmp_path)
    ended, outputs = wait_for_all(processes)
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
    # a sharded fine-tune: EMA and block swap are refused together; previews are not (every rank samples in step)
    samples = tmp_path / "samples.json"
    samples.write_text('[{"prompt": "a red square"}]')
    code = train_script.main(common + [argument for value in (
        "multi_gpu=true", "distributed.processes=2", "optimizer.ema=true", "performance.block_swap=1",
        f"sampling.samples_file={samples}") for argument in ("--config-value", value)])
    err = capsys.readouterr().err
    assert code == 2
    assert "optimizer.ema: not supported" in err and "performance.block_swap:" in err
    assert "sampling.samples_file" not in err


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
    for field in ("optimizer.ema", "performance.block_swap"):
        assert f"{field}: " in err and "multi-GPU run (distributed.shard_base)" in err, err
    assert "sampling.samples_file" not in err   # previews run on every rank in step
    # offloading shards where every GPU holds the whole base
    values = ["distributed.shard_base=false", "distributed.cpu_offload=true"]
    assert train_script.main(common + [a for v in values for a in ("--config-value", v)]) == 2
    assert "distributed.cpu_offload: offloads the shards of a sharded run" in capsys.readouterr().err


def test_ranks_on_one_machine_share_one_host_copy_of_the_swapped_blocks(tiny_model, squares_dataset, tmp_path):
    """Block swap over two data-parallel ranks: the swapped blocks' frozen weights lie in one shared-memory file both
    processes map (the same file, device and inode in /proc/self/maps, its name removed once both mapped), not in
    a copy each; training is bit-identical to each rank keeping its own copy."""
    overrides = COMMON + ["batch_size=1", "performance.block_swap=1", "gradient_checkpointing=true"]
    base = tiny_model("wan2.1-t2v")
    shared = run_ranks(tmp_path / "shared", base, squares_dataset, overrides, steps=2)
    own = run_ranks(tmp_path / "own", base, squares_dataset, overrides, steps=2, unshared_host=True)
    maps = [rank["swapped_host"] for rank in shared]
    assert maps[0] == maps[1] and len(maps[0]) > 0
    assert all("/wan-trainer-host-" in path and path.endswith("(deleted)") for path, _, _ in maps[0]), maps[0]
    assert len({tuple(region) for region in maps[0]}) == 1   # one mapping holds them all
    assert not any("wan-trainer-host-" in region[0] for rank in own for region in rank["swapped_host"])
    assert shared[0]["losses"] == own[0]["losses"] and shared[1]["losses"] == own[1]["losses"]
