"""The layouts beyond DDP and a sharded base (gloo on the CPU, 2 ranks), each against one process: context parallel
(one clip's tokens over the ranks), expert-parallel A14B (one expert per rank), and two torchrun agents meeting at a
c10d rendezvous as two machines do (a killed rank stops both; the resume is bit-identical)."""
import json
import shlex
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from learning import train
from modules.trainer.backup_io import read_backup
from modules.util.config.TrainConfig import TrainConfig
from multi_gpu_runs import (BACKUP_AT, COMMON, EXPERT_VALUES, GIB, ROOT, STEPS, assert_same_tensors, cli_arguments,
                            planned_trace, preview_strip, preview_values, run_ranks,
                            start_agents, wait_for_all)


@pytest.fixture(scope="module")
def context_runs(lora_runs, squares_dataset, tiny_model):
    """In one pair of processes: the LoRA training of lora_runs' single process (batch 2) on 1 data-parallel group x
    2 context-parallel ranks, then expert_runs' A14B training with one expert per rank and its resume, then the tiny
    transformer's forward and backward with its tokens split over both ranks."""
    tmp = lora_runs["tmp"]
    experts = tmp / "experts"
    a14b = tiny_model("wan2.2-t2v-a14b")
    cache = f"cache_dir={experts / 'high' / 'cache'}"
    singles = {side: train(experts / side, a14b, squares_dataset, steps=STEPS,
                           overrides=EXPERT_VALUES + [f"expert={side}", "batch_size=2", cache])
               for side in ("high", "low")}
    runs = {name: {"tmp": str(experts / name), "results": str(experts / name / "results"), "base": str(a14b),
                   "overrides": EXPERT_VALUES + ["expert=both", "batch_size=2", cache]}
            for name in ("ranks", "resumed")}
    runs["ranks"]["overrides"] += preview_values(experts, at=STEPS)
    runs["resumed"]["resume_from"] = str(experts / "ranks" / "run")
    for run in runs.values():
        Path(run["results"]).mkdir(parents=True)
    ranks = run_ranks(tmp / "context", lora_runs["base"], squares_dataset,
                      COMMON + ["batch_size=2", "distributed.context_parallel=2", f"cache_dir={tmp / 'single' / 'cache'}",
                                *preview_values(tmp)],
                      context_check=str(tmp / "context" / "check"), then=[runs["ranks"], runs["resumed"]])
    return {"ranks": ranks, "check": tmp / "context" / "check",
            "experts": {"tmp": experts, "singles": singles, "base": a14b,
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
    """Wan 2.2 A14B LoRA in one process with `expert: high` and with `expert: low` (batch 2 each, the same seed and
    data), and `expert: both` expert parallel on 2 ranks (in context_runs' processes): rank 0 the high-noise expert,
    rank 1 the low-noise one, each taking the whole global batch of 2 in every step; then the same 2-rank run resumed
    from its backup of step BACKUP_AT."""
    return context_runs["experts"]


def test_expert_parallel_trains_both_experts_in_every_step_as_two_one_expert_runs(expert_runs):
    singles, ranks, tmp = expert_runs["singles"], expert_runs["ranks"], expert_runs["tmp"]
    assert [rank["own_expert"] for rank in ranks] == ["transformer", "transformer_2"]
    assert ranks[0]["layout"].startswith("expert parallel")
    # every step trained both experts: its loss is the mean of the one-expert runs' losses of that step
    assert len(ranks[0]["losses"]) == STEPS
    both = [(high + low) / 2 for high, low in zip(singles["high"].step_losses, singles["low"].step_losses)]
    assert ranks[0]["losses"] == pytest.approx(both, abs=1e-6)
    assert ranks[1]["losses"] == ranks[0]["losses"]
    # each expert's file is the one-expert run's, bit for bit (each half is that run, with a group of one rank)
    for side, suffix in (("high", "_high_noise"), ("low", "_low_noise")):
        saved, alone = (load_file(str(tmp / name / f"out{suffix}.safetensors")) for name in ("ranks", side))
        assert saved.keys() == alone.keys()
        assert all(torch.equal(saved[key], alone[key]) for key in saved), side
    # the backup holds both experts' adapters, gathered from their ranks: each one-expert run's at that step
    parallel = read_backup(next((tmp / "ranks" / "run" / "backup").glob(f"*/step-{BACKUP_AT:08d}")))
    for side, expert in (("high", "transformer."), ("low", "transformer_2.")):
        alone = read_backup(next((tmp / side / "run" / "backup").glob(f"*/step-{BACKUP_AT:08d}")))["trainable"]
        assert {k for k in parallel["trainable"] if k.startswith(expert)} == alone.keys()
        assert all(torch.equal(parallel["trainable"][key], alone[key]) for key in alone), side


def test_expert_parallel_validation_is_that_of_both_trained_experts(expert_runs):
    """The validation loss at the end: the whole schedule's sigmas, each evaluated by its expert on the rank that
    holds it, equals one process evaluating with the high-noise expert of the `high` run and the low-noise expert of
    the `low` run."""
    from modules.trainer.ValidationEvaluator import ValidationEvaluator
    ranks, high, low = expert_runs["ranks"], expert_runs["singles"]["high"], expert_runs["singles"]["low"]
    high.model.transformer_2 = low.model.transformer_2
    high.config.expert = "both"
    expected = ValidationEvaluator(high).evaluate()
    assert [step for step, _ in ranks[0]["validation"]] == [STEPS]
    assert ranks[0]["validation"][0][1] == pytest.approx(expected.loss, abs=1e-6)
    assert ranks[1]["validation"] == ranks[0]["validation"]


def test_expert_parallel_resumes_bit_identically(expert_runs):
    tmp = expert_runs["tmp"]
    for suffix in ("_high_noise", "_low_noise"):
        resumed, uninterrupted = (load_file(str(tmp / name / f"out{suffix}.safetensors"))
                                  for name in ("resumed", "ranks"))
        assert resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[key], uninterrupted[key]) for key in resumed), suffix


def test_expert_parallel_preview_samples_both_experts_trained_adapters(expert_runs):
    """Rank 0 holds the high-noise expert; its preview at the last step is what the saved pair of files samples
    (the low-noise expert's adapter came from rank 1), and not what the high-noise file alone samples."""
    import numpy as np
    from modules.modelSampler.sampling_io import apply_lora_files, load_model_for_sampling
    from modules.modelSampler.TrainingSampler import frame_strip
    from modules.modelSampler.WanModelSampler import WanModelSampler
    from modules.util.enum.DataType import DataType
    from modules.util.sample_definitions import load_sample_definitions
    tmp = expert_runs["tmp"]
    preview = np.asarray(Image.open(next((tmp / "ranks" / "run" / "samples").glob(f"*/0-a-red-square/{STEPS}-*.png"))))
    sample = load_sample_definitions(str(tmp / "samples.json"))[0]

    def sampled(*files):
        model = load_model_for_sampling(str(expert_runs["base"]), DataType.FLOAT_32, torch.device("cpu"))
        apply_lora_files(model, [(file, 1.0) for file in files])
        return frame_strip(WanModelSampler(model, device=torch.device("cpu")).sample(sample).frames_uint8())

    pair = sampled(tmp / "ranks" / "out.safetensors")
    assert abs(preview.astype(int) - pair.astype(int)).max() <= 1
    high_only = sampled(tmp / "ranks" / "out_high_noise.safetensors")
    assert abs(preview.astype(int) - high_only.astype(int)).max() > 1


def test_expert_parallel_refuses_a_sigma_range_that_leaves_an_expert_nothing(tiny_model, squares_dataset, tmp_path,
                                                                             capsys):
    """Each half draws every step's sigmas in its own expert's range: max_sigma under the boundary (0.875) leaves the
    high-noise half none, said before any model loads (one process `both` would just route every step low)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train as train_script
    argv = cli_arguments(tiny_model("wan2.2-t2v-a14b"), squares_dataset, tmp_path, tmp_path / "cache",
                         ["multi_gpu=true", "distributed.processes=2", "expert=both", "timestep.max_sigma=0.5"])
    assert train_script.main(argv) == 2
    err = capsys.readouterr().err
    assert "has no sigma in the high-noise expert's range" in err and "distributed.expert_parallel false" in err
    assert not (tmp_path / "cache").exists()


def test_expert_parallel_is_planned_per_gpu_and_is_what_a14b_both_runs(tiny_model):
    """A14B `both` on 2 GPUs: each GPU holds one expert (half of both experts' weights), a step makes two expert
    updates in one expert step's time, and the plan the trainer checks at the start is expert parallel unless
    distributed.expert_parallel is off."""
    from modules.planner.parallel_plan import choose, configured, plan_layouts, report
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
    # the step: each GPU computes one expert's step on its batch in either layout, but expert parallel updates both
    # experts (DDP one, on twice the batch) and all-reduces within a half only: twice the expert updates per second
    assert (experts.expert_updates, whole.expert_updates) == (2, 1)
    assert experts.clips_per_step == whole.clips_per_step == 2
    assert 0 < experts.step_seconds <= whole.step_seconds
    gain = 2 * whole.step_seconds / experts.step_seconds
    text = report(list(plans.values()), experts, None)
    assert (f"expert parallel: 2 expert updates a step (1 clip(s) each) against DDP's 1 (2 clip(s)): x{gain:.2f} "
            f"expert updates per second") in text
    # so auto_fit takes it first whenever it fits, and DDP when only the whole pair fits
    assert choose(list(plans.values()), whole.peak_gib + 1) is experts
    config.distributed.expert_parallel = False
    assert configured(list(plans.values()), config, None).layout == "DDP"


def test_two_node_rendezvous_a_killed_rank_stops_all_and_the_resume_is_bit_identical(lora_runs, squares_dataset,
                                                                                       tmp_path):
    """Rank 1 is killed (SIGKILL) in step 5, after the backup of step 3: both agents end within a minute, rank 1's
    agent names it, the surviving rank prints the command that resumes; that command, run on both agents, trains
    steps 4 and 5 and saves one file, bit for bit the file of the same 2-rank training never interrupted."""
    cache = lora_runs["tmp"] / "single" / "cache"
    argv = cli_arguments(lora_runs["base"], squares_dataset, tmp_path, cache,
                         COMMON + ["batch_size=1", f"max_steps={STEPS}", "output.format=COMFY_LORA"])
    agents = start_agents({"argv": argv, "fail_rank": 1, "kill_at": STEPS}, tmp_path / "killed")
    ended, outputs = wait_for_all(agents)
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
