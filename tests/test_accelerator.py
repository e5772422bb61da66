"""Accelerators (DESIGN.md section 13): a step/CFG-distill LoRA read in the layouts its publishers use, applied around
a sample and removed after, on LightX2V's step-distill schedule, guidance 1.

Layouts (what the readers of the published files read; no published file is available here):
- LightX2V's own loader (github.com/ModelTC/LightX2V, lightx2v/common/ops/utils.py `build_lora_and_diff_names`):
  `<prefix>.<official module>.lora_down.weight / .lora_up.weight / .alpha` and the full-weight deltas `.diff` (added
  to the weight) and `.diff_b` (added to the bias) (mm_weight.py: `self.weight + self.weight_diff`); the prefix of
  the lightx2v Wan LoRAs is `diffusion_model.` (ComfyUI-WanVideoWrapper issue 807 quotes
  `diffusion_model.blocks.N.diff_m` keys of Wan21_I2V_14B_lightx2v_cfg_step_distill_lora_rank64).
- lora_A / lora_B under `diffusion_model.` (LightX2V's base_model.py renames `lora_A` to `lora_down` on load).
- diffusers' reader of these files (diffusers/loaders/lora_conversion_utils.py
  `_convert_non_diffusers_wan_lora_to_diffusers`, the lightx2v / CausVid / AccVideo support of diffusers PRs 12040 and
  12074): `diffusion_model.` prefix, lora_A/B or lora_down/up, `.alpha`, `.diff_b` on attention, FFN,
  `time_projection.1` and `head.head`, `.diff` / `.diff_b` on norms; AccVideo has `time_projection` biases without
  weights. The Wan2.2-Lightning files pair `.alpha` with `lora_down` / `lora_up` (DiffSynth-Studio issue 1067's
  converter).
- kohya `lora_unet_<official module, dots as _>` (the project's own reader; musubi-tuner writes it).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import av
import pytest
import torch
from diffusers.utils.torch_utils import randn_tensor
from safetensors.torch import save_file

from modules.model.WanModel import WanModel
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.accelerator import accelerated, accelerator_sigmas, load_accelerator
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.AcceleratorConfig import AcceleratorConfig
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.lora.accelerator_files import AcceleratorError, accelerator_problems, read_accelerator_file
from modules.util.lora.apply import merge_lora
from modules.util.lora.formats import LoraModule
from modules.util.lora.keys import diffusers_module_to_original

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a red square moving left"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(folder: Path) -> WanModel:
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))


def _accelerator_parts(transformer, seed: int):
    """(low-rank modules, full-weight deltas) touching attention, FFN, a norm and biases, in diffusers names."""
    generator = torch.Generator().manual_seed(seed)
    lora, deltas = {}, {}
    for name, module in transformer.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("blocks.") and (".attn" in name or ".ffn" in name):
            lora[name] = LoraModule(down=torch.randn(4, module.in_features, generator=generator) * 0.3,
                                    up=torch.randn(module.out_features, 4, generator=generator) * 0.3, alpha=2.0)
            deltas[f"{name}.bias"] = torch.randn(module.out_features, generator=generator) * 0.1
    norm = transformer.blocks[0].norm2
    assert norm.weight is not None, "the tiny model's cross-attention norm has an affine weight"
    deltas["blocks.0.norm2.weight"] = torch.randn(norm.weight.shape, generator=generator) * 0.1
    deltas["blocks.0.attn1.to_out.0.weight"] = torch.randn(transformer.blocks[0].attn1.to_out[0].weight.shape,
                                                           generator=generator) * 0.05
    # AccVideo's time_projection bias alone, and the head's bias (head.head.diff_b)
    deltas["condition_embedder.time_proj.bias"] = torch.randn(transformer.condition_embedder.time_proj.bias.shape,
                                                              generator=generator) * 0.1
    deltas["proj_out.bias"] = torch.randn(transformer.proj_out.bias.shape, generator=generator) * 0.1
    return lora, deltas


def _write(path: Path, lora: dict, deltas: dict, layout: str) -> Path:
    """An accelerator file in `layout`: lightx2v (lora_down/up/alpha + .diff/.diff_b), lora_a_b (lora_A/B + alpha +
    .diff/.diff_b) or kohya (lora_unet_ underscored, lora_down/up/alpha)."""
    sd = {}

    def stem(module: str) -> str:
        original = diffusers_module_to_original(module)
        return "lora_unet_" + original.replace(".", "_") if layout == "kohya" else "diffusion_model." + original
    for name, module in lora.items():
        down, up = (".lora_A.weight", ".lora_B.weight") if layout == "lora_a_b" else (".lora_down.weight",
                                                                                     ".lora_up.weight")
        sd[stem(name) + down], sd[stem(name) + up] = module.down.contiguous(), module.up.contiguous()
        sd[stem(name) + ".alpha"] = torch.tensor(module.alpha)
    if layout != "kohya":
        for name, delta in deltas.items():
            module, _, parameter = name.rpartition(".")
            sd[stem(module) + (".diff_b" if parameter == "bias" else ".diff")] = delta.contiguous()
    save_file(sd, str(path))
    return path


def _forward(transformer, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    config = transformer.config
    latents = torch.randn(1, config.in_channels, 2, 8, 8, generator=generator)
    text = torch.randn(1, 6, config.text_dim, generator=generator)
    with torch.no_grad():
        return transformer(hidden_states=latents, timestep=torch.tensor([700.0]), encoder_hidden_states=text,
                           return_dict=False)[0]


@pytest.mark.parametrize("layout", ["lightx2v", "lora_a_b", "kohya"])
def test_an_accelerator_file_changes_the_model_as_merging_it_does_and_leaves_it_bit_identical(layout, tiny_model,
                                                                                              tmp_path):
    model = load(tiny_model("wan2.1-t2v"))
    transformer = model.transformer
    lora, deltas = _accelerator_parts(transformer, 1)
    path = _write(tmp_path / "accel.safetensors", lora, deltas, layout)
    strength = 0.7
    accelerator = load_accelerator(model, AcceleratorConfig(file=str(path), strength=strength))
    read = accelerator.files["transformer"]
    assert sorted(read.lora) == sorted(lora)
    assert sorted(read.deltas) == ([] if layout == "kohya" else sorted(deltas))

    # the reference: the weights merged as ComfyUI merges a LoRA (W + s * up @ down * alpha / rank, the project's
    # merge_lora) and the full deltas added (W + s * diff, b + s * diff_b: ComfyUI's and LightX2V's rule)
    reference = load(tiny_model("wan2.1-t2v")).transformer
    merge_lora(reference, lora, strength)
    parameters = dict(reference.named_parameters())
    if layout != "kohya":
        with torch.no_grad():
            for name, delta in deltas.items():
                parameters[name].add_(strength * delta)
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    plain = _forward(transformer)
    with accelerated(model, accelerator):
        fast = _forward(transformer)
    expected = _forward(reference)
    assert (fast - plain).abs().max() > 1e-2           # it changes the model
    torch.testing.assert_close(fast, expected, atol=1e-5, rtol=1e-5)
    after = transformer.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)   # bit-identical after
    assert torch.equal(_forward(transformer), plain)                # no hook left behind


def test_bad_accelerator_files_are_named(tiny_model, tmp_path):
    assert accelerator_problems(AcceleratorConfig()) == []
    missing = accelerator_problems(AcceleratorConfig(file=str(tmp_path / "gone.safetensors")))
    assert len(missing) == 1 and "sampling.accelerator.file" in missing[0] and "does not exist" in missing[0]
    not_lora = tmp_path / "weights.safetensors"
    save_file({"blocks.0.attn1.to_q.weight": torch.zeros(2, 2)}, str(not_lora))
    flux = tmp_path / "flux.safetensors"
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": torch.zeros(2, 4),
               "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight": torch.zeros(4, 2)}, str(flux))
    problems = accelerator_problems(AcceleratorConfig(file=str(not_lora), file_2=str(flux)))
    assert len(problems) == 2
    assert "sampling.accelerator.file " in problems[0] and "not a LoRA" in problems[0]
    assert "sampling.accelerator.file_2 " in problems[1] and "not a Wan LoRA" in problems[1]
    with pytest.raises(AcceleratorError, match="not a Wan LoRA"):
        read_accelerator_file(flux)


# ------------------------------------------------------------------------------------------------ the schedule

def lightx2v_sigmas(denoising_step_list, sample_shift):
    """Transcribed from LightX2V's WanStepDistillScheduler.set_denoising_timesteps
    (lightx2v/models/schedulers/wan/step_distill/scheduler.py, commit f8aee98)."""
    num_train_timesteps, sigma_max, sigma_min = 1000, 1.0, 0.0
    sigma_start = sigma_min + (sigma_max - sigma_min)
    sigmas = torch.linspace(sigma_start, sigma_min, num_train_timesteps + 1)[:-1]
    sigmas = sample_shift * sigmas / (1 + (sample_shift - 1) * sigmas)
    timesteps = sigmas * num_train_timesteps
    denoising_step_index = [num_train_timesteps - x for x in denoising_step_list]
    return timesteps[denoising_step_index], sigmas[denoising_step_index]


def lightx2v_step_post(latents, noise_pred, sigmas, step_index, infer_steps):
    """Transcribed from WanStepDistillScheduler.step_post (same file)."""
    flow_pred = noise_pred.to(torch.float32)
    sigma = sigmas[step_index].item()
    noisy_image_or_video = latents.to(torch.float32) - sigma * flow_pred
    if step_index < infer_steps - 1:
        sigma_n = sigmas[step_index + 1].item()
        noisy_image_or_video = noisy_image_or_video + flow_pred * sigma_n
    return noisy_image_or_video.to(latents.dtype)


def test_the_schedule_is_lightx2vs():
    timesteps, sigmas = lightx2v_sigmas([1000, 750, 500, 250], 5.0)
    assert accelerator_sigmas([1000, 750, 500, 250], 5.0) == pytest.approx(sigmas.tolist(), abs=1e-7)
    # shift 5 of 1, 0.75, 0.5, 0.25
    assert sigmas.tolist() == pytest.approx([1.0, 0.9375, 5 / 6, 0.625], abs=1e-6)
    assert timesteps.tolist() == pytest.approx([1000.0, 937.5, 833.3333, 625.0], abs=1e-3)


@pytest.mark.parametrize("variant", ["wan2.1-t2v", "wan2.2-t2v-a14b"])
def test_the_accelerated_sampler_equals_lightx2vs_loop(variant, tiny_model, tmp_path):
    """Our 4-step sample (diffusers' pipeline with the accelerator's scheduler) against LightX2V's loop transcribed
    above, on the same tiny model, accelerator, prompt embeddings and noise. A14B: the high-noise expert takes the
    steps whose timestep is at or above the boundary (875: the first two, LightX2V's boundary_step_index 2)."""
    model = load(tiny_model(variant))
    config = AcceleratorConfig(file=str(_write(tmp_path / "a.safetensors",
                                               *_accelerator_parts(model.transformer, 2), "lightx2v")),
                               strength=0.5)
    if model.transformer_2 is not None:   # Wan2.2-Lightning style: one file per expert
        config.file_2 = str(_write(tmp_path / "low.safetensors", *_accelerator_parts(model.transformer_2, 5),
                                   "lora_a_b"))
    accelerator = load_accelerator(model, config)
    if model.transformer_2 is not None:
        assert accelerator.files["transformer_2"].path.name == "low.safetensors"
    sample = SampleConfig(prompt=PROMPT, width=32, height=32, frames=5, steps=30, guidance=6.0, seed=11)
    result = WanModelSampler(model, device="cpu", accelerator=accelerator).sample(sample)
    assert result.sample.steps == 4 and result.sample.guidance == 1.0
    assert result.accelerator["timesteps"] == [1000, 750, 500, 250] and result.accelerator["steps"] == 4

    timesteps, sigmas = lightx2v_sigmas([1000, 750, 500, 250], 5.0)
    prompt_embeds = model.encode_text([PROMPT])
    shape = (1, model.latent_channels, 2, 32 // model.vae_spatial_stride, 32 // model.vae_spatial_stride)
    latents = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(11), dtype=torch.float32)
    experts = ["transformer"] * 4
    if model.transformer_2 is not None:
        experts = ["transformer", "transformer", "transformer_2", "transformer_2"]
        assert [t >= model.boundary_ratio * 1000 for t in timesteps.tolist()] == [True, True, False, False]
    with accelerated(model, accelerator), torch.no_grad():
        for index, t in enumerate(timesteps):
            noise_pred = getattr(model, experts[index])(hidden_states=latents, timestep=t.expand(1),
                                                        encoder_hidden_states=prompt_embeds, return_dict=False)[0]
            latents = lightx2v_step_post(latents, noise_pred, sigmas, index, 4)
    torch.testing.assert_close(result.latents, latents[0], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------ sample, train

def test_sample_script_with_an_accelerator(tiny_model, tmp_path):
    folder = tiny_model("wan2.1-t2v")
    model = load(folder)
    path = _write(tmp_path / "lightx2v.safetensors", *_accelerator_parts(model.transformer, 3), "lightx2v")
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "scripts" / "sample.py"), "--base-model-name", str(folder),
               "--accelerator", f"{path}:0.9", "--prompt", PROMPT, "--width", "32", "--height", "32",
               "--frames", "5", "--guidance", "5", "--seed", "3", "--output-dir", str(out),
               "--device", "cpu"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=environment)
    assert result.returncode == 0, result.stderr
    video = Path(result.stdout.splitlines()[0])
    with av.open(str(video)) as container:
        assert sum(1 for _ in container.decode(video=0)) == 5
    record = json.loads(video.with_suffix(".json").read_text())
    assert record["steps"] == 4 and record["guidance"] == 1.0
    assert record["accelerator"] == {"file": str(path), "file_2": "", "strength": 0.9, "steps": 4,
                                     "timesteps": [1000, 750, 500, 250], "shift": 5.0, "guidance": 1.0}
    assert "accelerator" in result.stderr and "4 steps" in result.stderr

    gone = subprocess.run(command[:4] + ["--accelerator", str(tmp_path / "gone.safetensors")] + command[6:],
                          capture_output=True, text=True, timeout=120, env=environment)
    assert gone.returncode == 2 and "--accelerator" in gone.stderr and "gone.safetensors" in gone.stderr


def test_previews_run_accelerated_and_leave_training_bit_identical(tiny_model, squares_dataset, tmp_path, capsys):
    from learning import train
    base = tiny_model("wan2.1-t2v")
    path = _write(tmp_path / "lightx2v.safetensors", *_accelerator_parts(load(base).transformer, 4), "lightx2v")
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": PROMPT, "width": 32, "height": 32, "frames": 5, "steps": 2,
                                    "guidance": 4.0, "seed": 1}]))
    common = ["optimizer.learning_rate=0.01"]
    plain = train(tmp_path / "plain", base, squares_dataset, steps=3, overrides=common)
    previewed = train(tmp_path / "previews", base, squares_dataset, steps=3,
                      overrides=common + [f"sampling.samples_file={samples}", "sampling.every_n_steps=1",
                                          "sampling.sample_before_training=true",
                                          f'sampling.accelerator={{"file": "{path}", "strength": 0.8}}'])
    assert previewed.step_losses == plain.step_losses
    final_plain, final_previewed = plain.setup.trainable_state_dict(), previewed.setup.trainable_state_dict()
    assert all(torch.equal(final_previewed[name], final_plain[name]) for name in final_plain)
    base_plain, base_previewed = plain.model.transformer.state_dict(), previewed.model.transformer.state_dict()
    assert all(torch.equal(base_previewed[name], base_plain[name]) for name in base_plain)

    records = sorted((tmp_path / "previews" / "run" / "samples").rglob("*.json"))
    assert len(records) == 4, records   # before training and after each of the 3 steps
    record = json.loads(records[0].read_text())
    assert record["steps"] == 4 and record["guidance"] == 1.0
    assert record["accelerator"]["file"] == str(path) and record["accelerator"]["strength"] == 0.8
    assert record["accelerator"]["timesteps"] == [1000, 750, 500, 250]
    assert "accelerator" in capsys.readouterr().out


def test_a_missing_accelerator_stops_training_before_any_model_loads(tiny_model, squares_dataset, tmp_path):
    from modules.util.config.config_io import ConfigError
    from learning import train
    with pytest.raises(ConfigError) as error:
        train(tmp_path / "run", tiny_model("wan2.1-t2v"), squares_dataset, steps=1,
              overrides=[f'sampling.accelerator={{"file": "{tmp_path / "gone.safetensors"}"}}'])
    assert any("sampling.accelerator.file" in problem and "gone.safetensors" in problem
               for problem in error.value.problems)
