"""The memory planner (modules/planner, issue 21): its trace of a training step on fake tensors against the same
step run for real, and its predictions at real size. Real-size plans trace the full model on fake tensors: a few
seconds each, nothing computed."""
import os
from pathlib import Path

import pytest
import torch

from modules.planner.plan_shapes import PlanShape
from modules.planner.step_trace import trace_step
from modules.util.config.TrainConfig import TrainConfig

GIB = 1024 ** 3
TINY_SHAPE = PlanShape(batch_size=1, frames=33, height=256, width=256)

SWITCHES = {
    "lora": dict(training_method="LORA", gradient_checkpointing=False),
    "fine-tune": dict(training_method="FINE_TUNE", gradient_checkpointing=False),
    "checkpoint every 1": dict(training_method="LORA", gradient_checkpointing=True),
    "checkpoint every 2": dict(training_method="LORA", gradient_checkpointing=True,
                               performance={"checkpoint_every": 2}),
    "block swap": dict(training_method="LORA", gradient_checkpointing=True, performance={"block_swap": 1}),
    "activation offload": dict(training_method="LORA", gradient_checkpointing=True,
                               performance={"activation_offload": True}),
    "dora": dict(training_method="LORA", gradient_checkpointing=False, lora={"dora": True}),
    "loha": dict(training_method="LORA", gradient_checkpointing=False, lora={"type": "LOHA"}),
    "lokr": dict(training_method="LORA", gradient_checkpointing=False, lora={"type": "LOKR"}),
    # the frozen accelerator's hooks (in the forward and the checkpointed recompute) and the teacher's pass
    "distill preserve": dict(training_method="LORA", gradient_checkpointing=True, distill={"mode": "preserve"}),
}


def tiny_config(folder, **values) -> TrainConfig:
    lora = {"rank": 4, "alpha": 4.0, **values.pop("lora", {})}
    return TrainConfig(**{"model": {"base_model_name": str(folder)}, "train_dtype": "BFLOAT_16",
                          "optimizer": {"optimizer": "ADAMW"}, "lora": lora, **values})


@pytest.mark.parametrize("switches", list(SWITCHES))
def test_prediction_matches_a_real_cpu_step(tiny_model, switches):
    """The planner's peak (fake tensors) is within 5 % of what the same step allocates for real on the CPU, counted
    by the same counter (the real step uses the setup's own predict; the planner its fake-tensor twin)."""
    from modules.planner.plan_shapes import resolve_architecture
    config = tiny_config(tiny_model("wan2.1-t2v"), **SWITCHES[switches])
    arch = resolve_architecture(config)
    torch.manual_seed(0)
    real, _ = trace_step(config, arch, TINY_SHAPE, fake=False)
    planned, _ = trace_step(config, arch, TINY_SHAPE, fake=True)
    assert real.peak > 0
    assert abs(planned.peak - real.peak) <= 0.05 * real.peak, (
        f"{switches}: planned {planned.peak} bytes, real {real.peak} bytes; "
        f"planned {planned.breakdown()}, real {real.breakdown()}")


# ---------------------------------------------------------------------------------------------------- real size

def preset_config(name: str, *overrides: str) -> TrainConfig:
    from modules.util.config.config_io import load_config
    from modules.util.presets import resolve_preset
    return load_config(preset_path=resolve_preset(name), overrides=overrides)


@pytest.fixture(scope="module")
def plans_13b():
    """1.3B LoRA r32 (the 16GB preset's setup) at 832x480, planned once per setting; `blocks`: the transformer cut
    to its first N blocks at the real width (as the memory guard plans presets): a trace takes time per block, and
    a check of what each block holds needs a few of them, not 30."""
    import dataclasses

    from modules.planner.memory_plan import predict
    from modules.planner.plan_shapes import resolve_architecture
    cache = {}

    def get(frames: int = 81, blocks: int | None = None, **values):
        key = (frames, blocks, tuple(sorted(values.items())))
        if key not in cache:
            overrides = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
            config = preset_config("wan 2.1 1.3B LoRA 16GB", *overrides)
            arch = resolve_architecture(config)
            if blocks is not None:
                arch = dataclasses.replace(arch, transformer={**arch.transformer, "num_layers": blocks})
            cache[key] = predict(config, PlanShape(1, frames, 480, 832), arch)
        return cache[key]
    return get


def test_more_checkpointing_never_predicts_more(plans_13b):
    """Four real-width blocks: every 2nd block checkpointed keeps two blocks' activations, every block none (the
    step's activations are per block, so four blocks show what thirty do)."""
    off = plans_13b(17, 4, gradient_checkpointing=False)
    every_2 = plans_13b(17, 4, **{"gradient_checkpointing": True, "performance.checkpoint_every": 2})
    every_1 = plans_13b(17, 4, **{"gradient_checkpointing": True, "performance.checkpoint_every": 1})
    assert off.traced_bytes > every_2.traced_bytes > every_1.traced_bytes


def test_more_swapped_blocks_never_predict_more(plans_13b):
    """21 of the 1.3B's blocks: enough to swap 10 and 20 of them (a swapped block's weights are its own)."""
    none = plans_13b(17, 21, **{"gradient_checkpointing": True, "performance.checkpoint_every": 1})
    ten = plans_13b(17, 21, **{"performance.block_swap": 10})
    twenty = plans_13b(17, 21, **{"performance.block_swap": 20})
    assert none.traced_bytes > ten.traced_bytes > twenty.traced_bytes
    assert twenty.host_pinned_bytes > ten.host_pinned_bytes > 0
    # each swapped 1.3B block holds about 1/30 of the 2.6 GiB bf16 weights: 10 blocks ~ 0.9 GiB off the device
    assert 0.7 * GIB < ten.parts["weights"] - twenty.parts["weights"] < 1.0 * GIB


def test_doubling_frames_roughly_doubles_activations(plans_13b):
    """41 -> 81 frames: 11 -> 21 latent frames (x1.9 tokens); without checkpointing the saved activations grow with
    the tokens (attention's saved tensors are linear in them: flash-style kernels keep no L x L matrix). Two
    real-width blocks: the activations are per block (and the embeddings' and head's, which grow alike)."""
    short = plans_13b(41, 2, gradient_checkpointing=False)
    long = plans_13b(81, 2, gradient_checkpointing=False)
    ratio = long.parts["activations"] / short.parts["activations"]
    assert 1.6 < ratio < 2.3, ratio


# Peers' figure for Wan 2.1 1.3B LoRA at 832x480x81 with gradient checkpointing, as issue 21 quotes it: 4.7 GiB.
# Its source was not found offline (searched: the docs and issues of musubi-tuner, diffusion-pipe, DiffSynth-Studio,
# finetrainers, diffusers). What was found is looser: musubi-tuner issue #150 (github.com/kohya-ss/musubi-tuner/
# issues/150): "~10GB VRAM" for a 1.3B LoRA at 61 frames on musubi's defaults, resolution not given; diffusion-pipe
# issue #153 (github.com/tdrussell/diffusion-pipe/issues/153): the official Wan code's float32 doubled activations.
# The figure cannot be for bf16 weights: at this shape the bf16 weights (2.64 GiB) and the 30 checkpointed blocks'
# inputs (30 x 32,760 tokens x 1536 x 2 bytes = 2.81 GiB) are 5.5 GiB before anything else. So the comparison is
# made at the settings musubi-tuner documents for a 1.3B LoRA (docs/wan.md, "Training": --fp8_base
# --optimizer_type adamw8bit --network_dim 32 --gradient_checkpointing): fp8 weights, AdamW 8-bit, rank 32 (the 16GB
# preset's), every block checkpointed. Predicted here: 9.2 GiB (1.96x; 9.8 GiB before performance.recompute_norms);
# with the preset's bf16 weights 10.5 GiB (2.2x). Even with fp8 weights the weights and checkpoint inputs come to
# 4.2 GiB, which leaves a recomputed block (its feed-forward's 8960-wide hidden state alone is 0.55 GiB per tensor)
# no room under 4.7 GiB: at this shape the figure needs the checkpoint inputs offloaded (activation offload:
# predicted 6.5 GiB). Not yet measured on a GPU (`benchmark proof`).
PEER_13B_LORA_GIB = 4.7


def test_13b_lora_within_2x_of_peers(plans_13b):
    prediction = plans_13b(81, **{"gradient_checkpointing": True, "performance.checkpoint_every": 1,
                                  "model.transformer.weight_dtype": "FLOAT_8"})
    assert "norms recomputed" in prediction.features
    assert PEER_13B_LORA_GIB / 2 <= prediction.peak_gib <= PEER_13B_LORA_GIB * 2, prediction.report()


# ---------------------------------------------------------------------------------------------------- presets

def sized_presets() -> list[tuple[str, int]]:
    """(name, GB in the name) of every shipped preset that names a card size."""
    import re

    from modules.util.presets import PRESET_DIR
    found = []
    for path in sorted(PRESET_DIR.glob("*.json")):
        size = re.search(r"(\d+)\s*GB", path.stem)
        if size:
            found.append((path.stem.lstrip("#"), int(size.group(1))))
    return found


@pytest.mark.parametrize("name,size_gb", sized_presets())
def test_every_sized_preset_fits_the_card_in_its_name(name, size_gb):
    """At its largest bucket, on paper: a "24GB" card has 24 x 10^9 bytes, 22.35 GiB (the allowance for the CUDA
    context and fragmentation is inside the prediction). A full plan takes minutes per preset on a CPU (an Animate
    14B preset about three), too long for every CI run: the figure is the full plan `benchmark presets --plan
    --write` stored in docs/memory_presets.json. The memory guard (test_memory_guard.py) plans every preset as it is
    now and fails when one grows more than its tolerance over the stored numbers, and the 14B planning test below
    checks that a stored full plan is what the planner predicts today; so the stored figure plus the guard's
    tolerance must fit the card."""
    from modules.planner import preset_guard
    rows = {row["preset"]: row for row in preset_guard.load_stored()["full"]}
    row = rows.get(name, {})
    assert "predicted_gib" in row, f"{name}: no stored full plan ({row.get('status', 'missing')}); run " \
                                   f"`benchmark presets --plan --write`"
    assert row["predicted_gib"] * 1024 ** 3 * (1 + preset_guard.TOLERANCE) <= size_gb * 1e9, row


def _tree_pss_gib(pid: int) -> float:
    """The proportional set size of process `pid` and every process under it, in GiB: each shared page counted
    once over the tree (its RSS would count the pages a forked worker shares with its parent in both)."""
    from pathlib import Path
    total, pending = 0, [pid]
    while pending:
        one = pending.pop()
        try:
            rollup = Path(f"/proc/{one}/smaps_rollup").read_text()
            for task in Path(f"/proc/{one}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, PermissionError):   # it ended between two reads
            continue
        total += next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
    return total / 2 ** 20


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file() or
                    not Path(f"/proc/self/task/{os.getpid()}/children").is_file(),
                    reason="the planner's memory is read from Linux's /proc (smaps_rollup, task children)")
def test_planning_a_14b_step_is_small_and_matches_the_stored_row(tmp_path):
    """Under 2 GiB of RAM, its process and its trace workers together (their summed PSS, sampled every 20 ms from
    outside: a sampling thread inside would change how the workers start), imports included. Its time is a
    benchmark figure (`benchmark plan` prints "planned in N s"), not asserted here: a shared CI machine's load
    decides it more than the planner does (the timeout catches a planner that no longer ends)."""
    import json
    import subprocess
    import sys
    import time
    code = ("import json, resource, time; t = time.perf_counter();"
            "from modules.planner.memory_plan import predict;"
            "from modules.util.config.config_io import load_config;"
            "from modules.util.presets import resolve_preset;"
            "p = predict(load_config(preset_path=resolve_preset('wan 2.1 14B LoRA 24GB')));"
            "from modules.planner.trace_pool import workers;"
            "print(json.dumps({'seconds': time.perf_counter() - t, 'peak_gib': p.peak_gib, 'workers': workers(),"
            "'rss_gib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,"
            "'worker_rss_gib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}))")
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    deadline, tree_gib = time.monotonic() + 300, 0.0
    try:
        while process.poll() is None and time.monotonic() < deadline:
            tree_gib = max(tree_gib, _tree_pss_gib(process.pid))
            time.sleep(0.02)
    finally:
        if process.poll() is None:
            process.kill()
    stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr[-3000:]
    numbers = json.loads(stdout.strip().splitlines()[-1]) | {"tree_pss_gib": tree_gib}
    assert numbers["peak_gib"] > 8         # a 14B run was planned at its real size (9.9 GiB; a 1.3B plans under 8)
    from modules.planner import preset_guard   # the stored table is today's plan (the sized-preset test reads it)
    stored = {row["preset"]: row for row in preset_guard.load_stored()["full"]}["wan 2.1 14B LoRA 24GB"]
    assert numbers["peak_gib"] == pytest.approx(stored["predicted_gib"], rel=1e-6), (numbers, stored)
    # the cut traces run in worker processes side by side (trace_pool.py); the numbers say each one's peak RSS
    assert 0.1 < numbers["tree_pss_gib"] < 2, numbers


def test_train_refuses_a_run_that_does_not_fit_before_anything_loads(monkeypatch, capsys, squares_dataset):
    """train.py --vram-gib 2 with the 1.3B 16GB preset: exit 2, the prediction and the switches that fit named, and
    the trainer (which loads the weights) never constructed."""
    import importlib
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    train = importlib.import_module("train")
    import modules.trainer.GenericTrainer as generic

    def never(*_args, **_kwargs):
        raise AssertionError("the trainer was constructed: weights would load")

    monkeypatch.setattr(generic.GenericTrainer, "__init__", never)
    code = train.main(["--preset-path", "wan 2.1 1.3B LoRA 16GB", "--vram-gib", "2",
                       "--config-value", "data.frame_buckets=[1, 17]",
                       "--config-value", f'data.concepts=[{{"path": "{squares_dataset}"}}]'])   # no data: refused
    err = capsys.readouterr().err
    assert code == 2, err
    assert "predicted peak" in err and "does not fit the 2.0 GiB" in err, err
    # the chunked feed-forward made room: the refusal names the switches that fit (it said "nothing fits" before)
    assert "fits 2 GiB with" in err and "set those switches, or performance.auto_fit" in err, err


# ---------------------------------------------------------------------------------------------------- GUI

def test_gui_controller_shows_the_prediction_and_fits_the_config(tiny_model):
    """The training tab's controller (no toolkit): a prediction line for a card size, and "fit to my card" writes
    the cheapest fitting switches into the edited config (the tiny model fits 4 GiB without checkpointing)."""
    from modules.ui.MemoryPlanController import MemoryPlanController
    from modules.ui.UIState import UIState
    state = UIState({"model": {"base_model_name": str(tiny_model("wan2.1-t2v"))}, "gradient_checkpointing": True,
                     "data": {"resolution": 64, "frame_buckets": [9]}, "optimizer": {"optimizer": "ADAMW"}})
    controller = MemoryPlanController(state)
    assert controller.predict(4.0)
    controller.wait(120)
    text = controller.poll()
    assert text is not None and text.startswith("fits 4 GiB: ") and " GiB predicted" in text, text
    assert controller.fit(4.0)
    controller.wait(300)
    text = controller.poll()
    assert text.startswith("fits 4 GiB") and text.endswith("; fit set gradient_checkpointing = False"), text
    assert state.get("gradient_checkpointing") is False     # the cheapest switch setting that fits
    assert controller.fit(4.0)
    controller.wait(300)
    assert controller.poll().endswith("; it fits as set, nothing changed")
    assert controller.fit(0.1)
    controller.wait(300)
    assert controller.poll().startswith("nothing fits 0.1 GiB")


def test_planning_in_a_thread_leaves_models_built_elsewhere_real():
    """The window plans memory (and reads model files) in worker threads while the training worker builds its model.
    accelerate's init_empty_weights swapped torch's register_parameter for the whole process: a module built
    meanwhile got meta parameters, and with diffusers' own use of it left in another order the swap stayed, so every
    later Start in the window failed with "Cannot copy out of meta tensor"."""
    import threading

    from accelerate import init_empty_weights

    from modules.util.empty_weights import empty_weights
    inside, release, built = threading.Event(), threading.Event(), {}

    def plan():
        with empty_weights():
            built["planned"] = torch.nn.BatchNorm1d(2)
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=plan)
    thread.start()
    assert inside.wait(30)
    trained = torch.nn.Linear(2, 2)          # the training worker's model, built while the plan is traced
    with init_empty_weights():               # diffusers' from_pretrained in the training worker, left first
        pass
    release.set()
    thread.join(30)
    assert built["planned"].weight.is_meta and not built["planned"].running_mean.is_meta   # buffers stay real
    assert not trained.weight.is_meta and not torch.nn.Linear(2, 2).weight.is_meta


def test_caching_is_planned_one_encoder_at_a_time():
    """The text encoder pass holds UMT5-XXL's bf16 weights (5.7 B parameters, 10.6 GiB) and a little more; the VAE
    encode at 832x480x17 needs less with tiling than without."""
    from modules.planner.caching_plan import plan_caching
    from modules.planner.plan_shapes import resolve_architecture
    shape = PlanShape(1, 17, 480, 832)
    plain = preset_config("wan 2.1 1.3B LoRA 16GB", "performance.vae_tiling=false")
    arch = resolve_architecture(plain)
    untiled = plan_caching(plain, arch, shape)
    tiled = plan_caching(preset_config("wan 2.1 1.3B LoRA 16GB", "performance.vae_tiling=true"), arch, shape)
    assert 10.5 * GIB < untiled.text_encoder_bytes < 14 * GIB
    assert tiled.vae_bytes < untiled.vae_bytes


def test_sampling_previews_are_planned_on_top_of_the_training_state(tiny_model, tmp_path):
    """A preview larger than the training shape: its forward pass (training state kept) sets the peak."""
    import json
    from modules.planner.memory_plan import predict
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square", "width": 1024, "height": 1024, "frames": 81},
                                   {"prompt": "off", "width": 2048, "height": 2048, "frames": 81,
                                    "enabled": False}]))
    base = dict(gradient_checkpointing=True, data={"resolution": 64, "frame_buckets": [9]})
    plain = predict(tiny_config(tiny_model("wan2.1-t2v"), **base))
    with_previews = predict(tiny_config(tiny_model("wan2.1-t2v"), **base, sampling={"samples_file": str(samples)}))
    assert plain.preview_shape is None and plain.preview_bytes == 0
    assert with_previews.preview_shape == "81x1024x1024 batch 1"     # the disabled 2048x2048 sample is left out
    assert with_previews.preview_bytes > with_previews.traced_bytes
    assert with_previews.peak_bytes > plain.peak_bytes


def test_proof_needs_a_gpu_and_plans_its_runs(capsys):
    """`benchmark proof` refuses without CUDA (exit 2, nothing measured); each of its runs is planned with the
    benchmark's own arguments (here the 1.3B run with checkpointing)."""
    from pathlib import Path

    from modules.planner.proof import _planned, proof_runs, run_proof
    assert not torch.cuda.is_available()
    assert run_proof(Path("unused"), quick=True) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    run = proof_runs(quick=True)[0]
    arguments, prediction, words = _planned(run.arguments, run.fit_gib)
    assert arguments == run.arguments and words == "as given"
    assert prediction.shape == "81x480x832 batch 1" and "checkpointing 30/30 blocks" in prediction.features


def test_a_release_or_comfyui_folder_plans_as_its_diffusers_folder(tiny_model, tmp_path):
    """Users name the files they hold (issue 20): the planner reads the transformer's config from their tensor
    headers and predicts exactly what it predicts for the diffusers folder they were converted from."""
    from modules.planner.memory_plan import predict
    from tests.test_model_file_e2e import comfyui_folder, official_folder
    base = tiny_model("wan2.1-t2v")
    expected = predict(tiny_config(base), TINY_SHAPE)
    for folder in (official_folder(base, tmp_path / "official"), comfyui_folder(base, tmp_path / "comfyui")):
        planned = predict(tiny_config(folder), TINY_SHAPE)
        assert planned.peak_bytes == expected.peak_bytes and planned.parts == expected.parts, folder.name
