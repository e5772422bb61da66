"""A base read from official release or ComfyUI files samples (and previews) with its variant's official settings
(resources/wan_configs/<variant>.json "sampling", from the official Wan configs), not diffusers' hub default flow
shift 3; a diffusers folder keeps its own scheduler config; a sample's own settings win."""
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from modules.model.sampling_defaults import SamplingDefaults
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelLoader.wan.parts.wan_configs import released_configs
from modules.modelSampler.TrainingSampler import TrainingSampler
from modules.modelSampler.WanModelSampler import WanModelSampler
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.config.config_io import load_config
from modules.util.tiny_model_files import write_official_encoders
from tests.wan_file_layouts import (official_transformer_config, sample_tiny_video, transformer_to_original,
                                    vae21_to_original)

# Wan-Video/Wan2.1 generate.py and Wan-Video/Wan2.2 wan/configs/*.py: (shift, shift at 480p, steps, guidance of the
# (high-noise) transformer, guidance of the low-noise expert, boundary)
OFFICIAL = {"wan2.1-t2v-1.3b": (5.0, None, 50, 5.0, None, None), "wan2.1-t2v-14b": (5.0, None, 50, 5.0, None, None),
            "wan2.1-i2v-14b": (5.0, 3.0, 40, 5.0, None, None), "wan2.1-flf2v-14b": (16.0, None, 50, 5.0, None, None),
            "wan2.2-ti2v-5b": (5.0, None, 50, 5.0, None, None),
            "wan2.2-t2v-a14b": (12.0, None, 40, 4.0, 3.0, 0.875), "wan2.2-i2v-a14b": (5.0, None, 40, 3.5, 3.5, 0.9),
            # VACE: Wan2.1 generate.py gives vace tasks sample_shift 16; VACE-Fun A14B samples as T2V-A14B
            # Wan-Fun: VideoX-Fun's examples/wan2.1_fun and wan2.2_fun predict_v2v_control.py
            "wan2.1-fun-1.3b-control": (3.0, None, 50, 6.0, None, None),
            "wan2.1-fun-14b-control": (3.0, None, 50, 6.0, None, None),
            "wan2.1-fun-1.3b-inp": (3.0, None, 50, 6.0, None, None),
            "wan2.2-fun-a14b-control": (5.0, None, 50, 6.0, 6.0, 0.9),
            "wan2.1-vace-1.3b": (16.0, None, 50, 5.0, None, None), "wan2.1-vace-14b": (16.0, None, 50, 5.0, None, None),
            "wan2.2-vace-fun-a14b": (12.0, None, 40, 4.0, 3.0, 0.875),
            # Animate: Wan2.2 wan/configs/wan_animate_14B.py (Animate-2 has none of its own)
            "wan2.2-animate-14b": (5.0, None, 20, 1.0, None, None), "wan2.2-animate-2-14b": (5.0, None, 20, 1.0, None, None)}


def test_every_released_variant_carries_the_official_sampling_settings_with_their_source():
    for name, config in released_configs().items():
        d = SamplingDefaults.from_json(config["sampling"])
        assert (d.flow_shift, d.flow_shift_480p, d.steps, d.guidance, d.guidance_2, d.boundary_ratio) == \
            OFFICIAL[name], name
        assert d.source.startswith(("Wan-Video/Wan2.1 generate.py", "Wan-Video/Wan2.2 wan/configs/",
                                    "aigc-apps/VideoX-Fun examples/")), name
        assert config["model_index"].get("boundary_ratio") == d.boundary_ratio, name
    i2v = SamplingDefaults.from_json(released_configs()["wan2.1-i2v-14b"]["sampling"])
    assert [i2v.flow_shift_for(w, h) for w, h in ((832, 480), (480, 832), (320, 192), (1280, 720))] == \
        [3.0, 3.0, 3.0, 5.0]


@pytest.fixture(scope="module")
def a14b_release(tiny_model, tmp_path_factory):
    """Wan2.2-T2V-A14B as the official release ships it: high_noise_model/ and low_noise_model/ with the official
    config.json, Wan2.1_VAE.pth, the T5 .pth and google/umt5-xxl/."""
    a14b = tiny_model("wan2.2-t2v-a14b")
    release = tmp_path_factory.mktemp("a14b") / "Wan2.2-T2V-A14B-tiny"
    for expert, folder in (("transformer", "high_noise_model"), ("transformer_2", "low_noise_model")):
        (release / folder).mkdir(parents=True)
        state = load_file(str(a14b / expert / "diffusion_pytorch_model.safetensors"))
        save_file(transformer_to_original(state), str(release / folder / "model.safetensors"))
        config = json.loads((a14b / expert / "config.json").read_text())
        (release / folder / "config.json").write_text(json.dumps(official_transformer_config(config)))
    vae = load_file(str(a14b / "vae" / "diffusion_pytorch_model.safetensors"))
    torch.save(vae21_to_original(vae), release / "Wan2.1_VAE.pth")
    write_official_encoders(a14b, release)
    return release


def _resolved(model, **settings) -> tuple:
    sample, _ = WanModelSampler(model).resolve(SampleConfig(prompt="a red square", width=32, height=32, frames=5,
                                                            **settings), log=False)
    return sample.flow_shift, sample.steps, sample.guidance, sample.guidance_2


def test_an_official_release_samples_with_the_official_settings_and_a_diffusers_folder_with_its_own(
        a14b_release, tiny_model, tmp_path, capsys):
    model = WanBaseModelLoader().load(ModelConfig(base_model_name=str(a14b_release)))
    assert (model.boundary_ratio, model.noise_scheduler.config.flow_shift) == (0.875, 12.0)
    assert _resolved(model) == (12.0, 40, 4.0, 3.0)
    # what a sample sets wins; a guidance it sets applies to both experts (guidance_2 None)
    assert _resolved(model, steps=3, guidance=6.0, flow_shift=7.0) == (7.0, 3, 6.0, None)
    assert _resolved(model, guidance_2=2.0) == (12.0, 40, 4.0, 2.0)
    # training previews: the sampling section leaves steps and guidance to the model unless it sets them
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": "a red square", "width": 32, "height": 32, "frames": 5}]))
    for section, expected in (([], (12.0, 40, 4.0, 3.0)), (["sampling.steps=4", "sampling.guidance=2"],
                                                           (12.0, 4, 2.0, None))):
        config = load_config(overrides=[f"sampling.samples_file={samples}", *section])
        [preview] = TrainingSampler(SimpleNamespace(config=config)).load_samples()
        resolved, _ = WanModelSampler(model).resolve(preview.sample, log=False)
        assert (resolved.flow_shift, resolved.steps, resolved.guidance, resolved.guidance_2) == expected, section

    diffusers = WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.2-t2v-a14b"))))
    assert diffusers.sampling_defaults is None
    assert _resolved(diffusers) == (3.0, 20, 5.0, None)   # its scheduler_config.json, SampleConfig's defaults

    # sample.py says which settings fill in, and samples with them
    assert sample_tiny_video(a14b_release, tmp_path / "out", []) == 5
    assert "flow shift 12, 40 steps, guidance 4 high-noise / 3 low-noise expert, boundary 0.875 (Wan-Video/Wan2.2 " \
           "wan/configs/wan_t2v_A14B.py" in capsys.readouterr().err
