"""Issue 2: every tiny variant loads, saves as a diffusers folder and as an original-format single file, and loads
again with identical tensors and identical pipeline output; diffusers itself reads our single file."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import WanTransformer3DModel
from PIL import Image
from safetensors import safe_open

from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError, WanBaseModelLoader
from modules.modelSaver.wan.WanBaseModelSaver import WanBaseModelSaver
from modules.util.config.ModelConfig import ModelConfig, PartConfig
from modules.util.enum.DataType import DataType
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.WanVariant import WanVariant
from modules.util.tiny_models import VARIANTS
from modules.util.wan_detection import NotAWanModelError

ROOT = Path(__file__).resolve().parent.parent
EXPECTED_VARIANT = {"wan2.1-t2v": WanVariant.T2V, "wan2.1-i2v": WanVariant.I2V, "wan2.1-flf2v": WanVariant.FLF2V,
                    "wan2.2-ti2v-5b": WanVariant.TI2V_5B, "wan2.2-t2v-a14b": WanVariant.T2V_A14B,
                    "wan2.2-i2v-a14b": WanVariant.I2V_A14B, "wan2.1-vace": WanVariant.VACE,
                    "wan2.2-vace-fun-a14b": WanVariant.VACE_A14B, "wan2.1-fun-control": WanVariant.FUN_CONTROL,
                    "wan2.1-fun-inp": WanVariant.FUN_INP, "wan2.2-fun-control-a14b": WanVariant.FUN_CONTROL_A14B}


def load(path, **parts) -> object:
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(path), **parts))


def all_tensors(model) -> dict[str, torch.Tensor]:
    return {f"{part}.{k}": v for part, module in model.parts().items() for k, v in module.state_dict().items()}


def run_pipeline(model, seed=3):
    size = 64 if model.variant is WanVariant.TI2V_5B else 32
    kwargs = dict(prompt="a red square moving left", negative_prompt="blurry", height=size, width=size,
                  num_frames=5, num_inference_steps=2, guidance_scale=2.0, output_type="np",
                  generator=torch.Generator().manual_seed(seed))
    if model.variant.is_fun_control:   # no diffusers pipeline of its own: our sampler (the I2V loop, its condition)
        from modules.modelSampler.WanModelSampler import WanModelSampler
        from modules.util.config.SampleConfig import SampleConfig
        return WanModelSampler(model, "cpu").sample(SampleConfig(
            prompt=kwargs["prompt"], negative_prompt="blurry", width=size, height=size, frames=5, steps=2,
            guidance=2.0, seed=seed)).frames
    if model.variant.takes_image_condition:
        kwargs["image"] = Image.fromarray(np.full((size, size, 3), 200, np.uint8))
        if model.variant is WanVariant.FLF2V:
            kwargs["last_image"] = Image.fromarray(np.full((size, size, 3), 30, np.uint8))
    return model.create_pipeline()(**kwargs).frames[0]


def assert_same_tensors(a: dict, b: dict):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("variant", VARIANTS)
def test_load_save_load_is_identical(variant, tiny_model, tmp_path):
    original = load(tiny_model(variant))
    assert original.variant is EXPECTED_VARIANT[variant]
    reference_tensors = all_tensors(original)
    reference_frames = run_pipeline(original)

    WanBaseModelSaver().save(original, ModelFormat.DIFFUSERS, tmp_path / "diffusers")
    reloaded = load(tmp_path / "diffusers")
    assert reloaded.variant is original.variant
    assert reloaded.boundary_ratio == original.boundary_ratio
    assert_same_tensors(reference_tensors, all_tensors(reloaded))
    # the weights are bit-identical (above); loaded tensors may differ in memory layout, which changes float
    # reduction order by ~1e-6
    np.testing.assert_allclose(run_pipeline(reloaded), reference_frames, atol=1e-5, rtol=0)

    files = WanBaseModelSaver().save(original, ModelFormat.ORIGINAL, tmp_path / "original.safetensors")
    assert len(files) == (2 if original.variant.has_two_experts else 1)
    overrides = {"transformer": PartConfig(path=str(files[0]))}
    if len(files) == 2:
        assert [f.name for f in files] == ["original_high_noise.safetensors", "original_low_noise.safetensors"]
        overrides["transformer_2"] = PartConfig(path=str(files[1]))
    from_single = load(tiny_model(variant), **overrides)
    assert_same_tensors(reference_tensors, all_tensors(from_single))
    np.testing.assert_allclose(run_pipeline(from_single), reference_frames, atol=1e-5, rtol=0)


def test_original_file_has_official_names_and_modelspec(tiny_model, tmp_path):
    model = load(tiny_model("wan2.1-i2v"))
    path, = WanBaseModelSaver().save(model, ModelFormat.ORIGINAL, tmp_path / "t.safetensors", torch.bfloat16)
    with safe_open(str(path), "pt") as f:
        keys, metadata = set(f.keys()), f.metadata()
        assert f.get_tensor("blocks.0.self_attn.q.weight").dtype == torch.bfloat16
    assert {"blocks.0.cross_attn.k_img.weight", "head.head.weight", "img_emb.proj.1.weight"} <= keys
    assert metadata["modelspec.architecture"] == "wan_2_1_i2v"
    assert not list(tmp_path.glob(".*tmp"))  # atomic write left no temporary file


def test_diffusers_from_single_file_reads_our_file(tiny_model, tmp_path):
    folder = tiny_model("wan2.1-t2v")
    model = load(folder)
    path, = WanBaseModelSaver().save(model, ModelFormat.ORIGINAL, tmp_path / "t.safetensors")
    peer = WanTransformer3DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                  local_files_only=True, torch_dtype=torch.float32)
    assert_same_tensors(model.transformer.state_dict(), peer.state_dict())


def test_bf16_single_file_loads_without_float32_copy(tiny_model, tmp_path):
    model = load(tiny_model("wan2.1-t2v"))
    path, = WanBaseModelSaver().save(model, ModelFormat.ORIGINAL, tmp_path / "t.safetensors", torch.bfloat16)
    loaded = load(tiny_model("wan2.1-t2v"), transformer=PartConfig(path=str(path), weight_dtype=DataType.BFLOAT_16))
    dtypes = {name: p.dtype for name, p in loaded.transformer.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    # the modules diffusers keeps in float32 stay float32
    assert dtypes["blocks.0.scale_shift_table"] == torch.float32


def test_not_a_wan_folder_is_a_clear_error(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    with pytest.raises(NotAWanModelError, match="StableDiffusionPipeline"):
        load(tmp_path)
    with pytest.raises(ModelLoadError, match="allow_download"):
        load(tmp_path / "missing")


def test_a_hub_id_that_cannot_be_fetched_is_a_clear_error(tmp_path, monkeypatch):
    """A shipped preset names a hub id with allow_download: offline, Start ended in huggingface_hub's
    LocalEntryNotFoundError and a traceback, naming neither the field nor what to do."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))   # conftest: HF_HUB_OFFLINE=1
    config = ModelConfig(base_model_name="Wan-AI/Wan2.1-T2V-1.3B-Diffusers", allow_download=True)
    with pytest.raises(ModelLoadError, match=r"model.base_model_name 'Wan-AI/Wan2.1-T2V-1.3B-Diffusers': "
                                             r"model_index.json is neither in the Hugging Face cache nor "
                                             r"downloadable .*hf download .* --local-dir DIR"):
        WanBaseModelLoader().load(config)


def test_convert_model_both_ways(tiny_model, tmp_path):
    folder = tiny_model("wan2.1-t2v")
    script = [sys.executable, str(ROOT / "scripts" / "convert_model.py")]
    single = tmp_path / "wan.safetensors"
    subprocess.run(script + ["--input-name", str(folder), "--output-model-format", "ORIGINAL",
                             "--output-model-destination", str(single)], check=True, capture_output=True)
    back = tmp_path / "back"
    done = subprocess.run(script + ["--input-name", str(single), "--base-model-name", str(folder),
                                    "--output-model-format", "DIFFUSERS", "--output-model-destination", str(back)],
                          check=True, capture_output=True, text=True)
    assert str(back) in done.stdout
    assert_same_tensors(all_tensors(load(folder)), all_tensors(load(back)))
