"""A step-distilled base (lightx2v's Wan2.1-Distill-Models / Wan2.2-Distill-Models, bf16 and fp8 single files) is a
base like any other, sampled by default on its own schedule: LightX2V's step-distill schedule, guidance 1, no
negative pass (modules/util/distilled_base.py says what recognises one)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers.utils.torch_utils import randn_tensor
from safetensors.torch import save_file

from modules.modelSampler.accelerator import load_accelerator
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.AcceleratorConfig import AcceleratorConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.distilled_base import distilled_base
from test_accelerator import PROMPT, lightx2v_sigmas, lightx2v_step_post, load, one_thread  # noqa: F401 (autouse)

# LightX2V configs/distill/wan21/wan_t2v_distill_model_4step_cfg.json (commit f8aee98), the keys that matter
LIGHTX2V_DISTILL_CONFIG = {"infer_steps": 4, "sample_guide_scale": 6, "sample_shift": 5, "enable_cfg": False,
                           "denoising_step_list": [1000, 750, 500, 250],
                           "dit_original_ckpt": "lightx2v/Wan2.1-Distill-Models/wan2.1_t2v_14b_lightx2v_4step"
                                                ".safetensors"}
# LightX2V configs/causvid/wan_t2v_causvid.json
CAUSVID_LIST = [999, 934, 862, 756, 603, 410, 250, 140, 74]


def _weights(path: Path, metadata: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"blocks.0.self_attn.q.weight": torch.zeros(2, 2)}, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize("name", ["wan2.1_t2v_14b_lightx2v_4step.safetensors",
                                  "wan2.1_i2v_480p_scaled_fp8_e4m3_lightx2v_4step.safetensors",
                                  "wan2.2_i2v_A14b_high_noise_lightx2v_4step.safetensors"])
def test_a_published_name_alone_does_not_make_a_base_distilled(name, tmp_path):
    """Files are judged by content: lightx2v's names (the Distill-Models cards) without a config or header entry
    leave an ordinary base; the same file with LightX2V's config beside it is distilled."""
    weights = _weights(tmp_path / name)
    assert distilled_base(weights) is None
    (tmp_path / "wan_t2v_distill_model_4step_cfg.json").write_text(json.dumps(LIGHTX2V_DISTILL_CONFIG))
    found = distilled_base(weights)
    assert found is not None and (found.timesteps, found.shift) == ([1000, 750, 500, 250], 5.0)


def test_a_config_or_header_listing_the_schedule_gives_it(tmp_path):
    header = _weights(tmp_path / "header" / "model.safetensors",
                      {"config": json.dumps({"denoising_step_list": CAUSVID_LIST, "sample_shift": 8,
                                             "enable_cfg": False})})
    found = distilled_base(header)
    assert (found.timesteps, found.shift) == (CAUSVID_LIST, 8.0) and "header of model.safetensors" in found.source

    folder = tmp_path / "folder"
    _weights(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    (folder / "transformer" / "wan_t2v_distill_model_4step_cfg.json").write_text(json.dumps(LIGHTX2V_DISTILL_CONFIG))
    found = distilled_base(folder)
    assert (found.timesteps, found.shift) == ([1000, 750, 500, 250], 5.0)
    assert "wan_t2v_distill_model_4step_cfg.json" in found.source


def test_ordinary_bases_are_not_distilled(tiny_model, tmp_path):
    assert distilled_base(tiny_model("wan2.1-t2v")) is None
    assert distilled_base(_weights(tmp_path / "wan2.1_t2v_14b_bf16.safetensors")) is None
    cfg = _weights(tmp_path / "cfg" / "model.safetensors")   # a schedule with CFG on is an ordinary run config
    (cfg.parent / "run.json").write_text(json.dumps({**LIGHTX2V_DISTILL_CONFIG, "enable_cfg": True}))
    assert distilled_base(cfg) is None
    assert distilled_base(tmp_path / "gone.safetensors") is None


def test_the_schedule_alone_samples_as_lightx2vs_loop_with_the_base_unchanged(tiny_model):
    model = load(tiny_model("wan2.1-t2v"))
    accelerator = load_accelerator(model, AcceleratorConfig())
    assert accelerator.files == {} and "distilled base's own schedule: 4 steps" in accelerator.describe()
    result = WanModelSampler(model, device="cpu", accelerator=accelerator).sample(
        SampleConfig(prompt=PROMPT, width=32, height=32, frames=5, steps=30, guidance=6.0, seed=11))
    assert result.sample.steps == 4 and result.sample.guidance == 1.0

    timesteps, sigmas = lightx2v_sigmas([1000, 750, 500, 250], 5.0)
    prompt_embeds = model.encode_text([PROMPT])
    shape = (1, model.latent_channels, 2, 32 // model.vae_spatial_stride, 32 // model.vae_spatial_stride)
    latents = randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(11), dtype=torch.float32)
    with torch.no_grad():
        for index, t in enumerate(timesteps):
            noise_pred = model.transformer(hidden_states=latents, timestep=t.expand(1),
                                           encoder_hidden_states=prompt_embeds, return_dict=False)[0]
            latents = lightx2v_step_post(latents, noise_pred, sigmas, index, 4)
    torch.testing.assert_close(result.latents, latents[0], atol=1e-5, rtol=0)


def test_sample_runs_a_distilled_single_file_on_its_schedule_and_says_so(tiny_model, tmp_path, capsys):
    from test_model_file_e2e import comfyui_folder
    from tests.script_loader import load_script
    base = tiny_model("wan2.1-t2v")
    folder = comfyui_folder(base, tmp_path / "models")
    shutil.move(folder / "wan2.1_t2v_tiny_fp32.safetensors", folder / "wan2.1_t2v_14b_lightx2v_4step.safetensors")
    (folder / "wan_t2v_distill_model_4step_cfg.json").write_text(json.dumps(LIGHTX2V_DISTILL_CONFIG))
    script = load_script("sample")
    common = ["--base-model-name", str(folder), "--prompt", PROMPT, "--width", "32", "--height", "32", "--frames",
              "5", "--guidance", "5", "--device", "cpu", "--tokenizer", str(base / "tokenizer")]
    assert script.main([*common, "--output-dir", str(tmp_path / "fast")]) == 0
    [video] = (tmp_path / "fast").glob("*.mp4")
    record = json.loads(video.with_suffix(".json").read_text())
    assert record["steps"] == 4 and record["guidance"] == 1.0
    assert record["accelerator"]["file"] == "" and record["accelerator"]["timesteps"] == [1000, 750, 500, 250]
    err = capsys.readouterr().err
    assert "step-distilled model (wan_t2v_distill_model_4step_cfg.json lists" in err and "--no-accelerator" in err

    assert script.main([*common, "--steps", "2", "--no-accelerator", "--output-dir", str(tmp_path / "plain")]) == 0
    [plain] = (tmp_path / "plain").glob("*.mp4")
    assert not plain.with_suffix(".json").exists() and "step-distilled" not in capsys.readouterr().err


def test_previews_of_a_distilled_base_run_on_its_schedule(tiny_model, squares_dataset, tmp_path, capsys):
    from learning import train
    base = tmp_path / "distilled"
    shutil.copytree(tiny_model("wan2.1-t2v"), base)
    (base / "transformer" / "wan_t2v_distill_model_4step_cfg.json").write_text(json.dumps(LIGHTX2V_DISTILL_CONFIG))
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": PROMPT, "width": 32, "height": 32, "frames": 5, "steps": 2,
                                    "guidance": 4.0, "seed": 1}]))
    train(tmp_path / "run", base, squares_dataset, steps=1,
          overrides=[f"sampling.samples_file={samples}", "sampling.every_n_steps=1"])
    [record] = [json.loads(path.read_text()) for path in (tmp_path / "run").rglob("samples/**/*.json")]
    assert record["steps"] == 4 and record["guidance"] == 1.0
    assert record["accelerator"]["timesteps"] == [1000, 750, 500, 250] and record["accelerator"]["file"] == ""
    assert "previews: the base is a step-distilled model (wan_t2v_distill_model_4step_cfg.json" in \
        capsys.readouterr().out
