"""Wan2.2-Animate and Animate-2 model files: detected by content in diffusers folders, the official layout and
ComfyUI single files, and a file in official key names computes what the diffusers-folder model computes.

The official names and shapes (tests/fixtures/official_animate_key_names.json) were taken from the official module
itself (Wan-Video/Wan2.2 wan/modules/animate/model_animate.py WanAnimateModel at the tiny widths); the writer used
here (animate_files.diffusers_to_official) must give exactly those, so an inversion error cannot pass unseen."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import WanAnimate2Transformer3DModel, WanAnimateTransformer3DModel
from safetensors.torch import load_file, save_file

from modules.modelLoader.wan.WanBaseModelLoader import ModelLoadError, WanBaseModelLoader
from modules.modelLoader.wan.parts.animate_files import diffusers_to_official
from modules.modelLoader.wan.parts.model_plan import plan_model
from modules.util.config.ModelConfig import ModelConfig
from modules.util.empty_weights import empty_weights
from modules.util.enum.WanVariant import WanVariant
from modules.util.wan_detection import detect_variant_from_folder
from tests.wan_file_layouts import COMFY_PREFIX, to_fp8_scaled

_FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "official_animate_key_names.json").read_text())
OFFICIAL = next(v for k, v in _FIXTURE.items() if not k.startswith("_"))


def _state(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next((folder / "transformer").glob("*.safetensors"))))


def test_official_writer_gives_the_official_names_and_shapes():
    # the official module's fixed sizes: Generator(512, 512, 20), FaceEncoder 1024 wide with 4 heads, MLPProj(1280)
    with empty_weights():
        model = WanAnimateTransformer3DModel(num_attention_heads=2, attention_head_dim=32, in_channels=36,
                                             text_dim=32, ffn_dim=256, num_layers=5, image_dim=1280,
                                             added_kv_proj_dim=64)
    ours = {k: list(v.shape) for k, v in diffusers_to_official(model.state_dict()).items()}
    assert sorted(set(OFFICIAL) - set(ours)) == [] and sorted(set(ours) - set(OFFICIAL)) == []
    assert {k: (ours[k], s) for k, s in OFFICIAL.items() if ours[k] != s} == {}


def test_diffusers_folders_are_detected_by_their_transformer(tiny_model):
    assert detect_variant_from_folder(tiny_model("wan2.2-animate")) is WanVariant.ANIMATE_14B
    assert detect_variant_from_folder(tiny_model("wan2.2-animate-2")) is WanVariant.ANIMATE_2_14B
    assert WanVariant.ANIMATE_14B.takes_pose_video and WanVariant.ANIMATE_14B.takes_face_video
    assert WanVariant.ANIMATE_2_14B.takes_driving_video and not WanVariant.ANIMATE_2_14B.takes_pose_video


def _animate_inputs(transformer):
    generator = torch.Generator().manual_seed(0)
    config = transformer.config
    size = config.motion_encoder_size
    return dict(hidden_states=torch.randn(1, 36, 3, 4, 4, generator=generator),
                timestep=torch.tensor([500.0]),
                encoder_hidden_states=torch.randn(1, 512, config.text_dim, generator=generator),
                encoder_hidden_states_image=torch.randn(1, 17, config.image_dim, generator=generator),
                pose_hidden_states=torch.randn(1, 16, 2, 4, 4, generator=generator),
                # 5 face frames: the face encoder's two stride-2 convolutions give 2, plus the zero frame: 3 latents
                face_pixel_values=torch.rand(1, 3, 5, size, size, generator=generator) * 2 - 1)


def _animate_2_run(transformer):
    from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(16, 2, 4, 4, generator=generator)
    condition = torch.randn(20, 2, 4, 4, generator=generator)
    grid = torch.tensor([[2, 2, 2]])
    cache = WanAnimate2KVCache(transformer.config.num_layers)
    out = transformer([latents], torch.tensor([500.0]), [torch.randn(7, transformer.config.text_dim,
                                                                     generator=generator)],
                      [condition], cache, "extract", seq_len=8,
                      encoder_hidden_states_image=torch.randn(1, 17, 1280, generator=generator),
                      offset_grid_sizes=grid).sample[0]
    return torch.cat([out.flatten(), *(torch.cat(cache.get(i).get(), -1).flatten() for i in range(2))])


@pytest.fixture(scope="module")
def folder_models(tiny_model):
    return {name: WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model(name)))).transformer
            for name in ("wan2.2-animate", "wan2.2-animate-2")}


def _load_with_file(base: Path, file: Path):
    config = ModelConfig(base_model_name=str(base))
    config.transformer.path = str(file)
    return WanBaseModelLoader().load(config)


@pytest.mark.parametrize("prefix", ["", COMFY_PREFIX])
def test_official_animate_file_computes_what_the_folder_computes(tiny_model, folder_models, tmp_path, prefix):
    base = tiny_model("wan2.2-animate")
    official = {prefix + k: v for k, v in diffusers_to_official(_state(base)).items()}
    save_file(official, str(tmp_path / "Wan2_2-Animate-14B.safetensors"))
    loaded = _load_with_file(base, tmp_path / "Wan2_2-Animate-14B.safetensors")
    assert loaded.variant is WanVariant.ANIMATE_14B
    transformer = loaded.transformer
    assert isinstance(transformer, WanAnimateTransformer3DModel)
    # the image cross-attention (k_img / v_img) is read: added_kv_proj_dim is the width
    assert transformer.config.added_kv_proj_dim == transformer.config.num_attention_heads * 32
    reference = folder_models["wan2.2-animate"]
    with torch.no_grad():
        expected = reference(**_animate_inputs(reference)).sample
        got = transformer(**_animate_inputs(transformer)).sample
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_official_animate_file_without_a_config_beside_it_is_planned_by_its_shapes(tiny_model, tmp_path):
    base = tiny_model("wan2.2-animate")
    # a release-style folder: the transformer file alone beside the VAE / encoders from the diffusers folder; a
    # config.json beside the file that lacks added_kv_proj_dim (as from_single_file's default) changes nothing
    save_file(diffusers_to_official(_state(base)), str(tmp_path / "animate.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"_class_name": "WanAnimateModel", "dim": 64, "num_heads": 2}))
    config = ModelConfig(base_model_name=str(base))
    config.transformer.path = str(tmp_path / "animate.safetensors")
    plan = plan_model(config)
    assert plan.variant is WanVariant.ANIMATE_14B
    fields = plan.transformer_configs["transformer"]
    assert fields["added_kv_proj_dim"] == 64 and fields["motion_encoder_size"] == 16
    assert fields["_class_name"] == "WanAnimateTransformer3DModel"


def test_fp8_scaled_animate_file_loads_with_its_face_adapter_split(tiny_model, folder_models, tmp_path):
    base = tiny_model("wan2.2-animate")
    official = {COMFY_PREFIX + k: v for k, v in diffusers_to_official(_state(base)).items()}
    scaled = to_fp8_scaled(official)
    for key in [k for k in official if ".fuser_blocks." in k and k.endswith(".weight") and official[k].dim() == 2]:
        from modules.util.fp8_scaled import quantise_scaled_fp8
        scaled[key], scaled[key.removesuffix(".weight") + ".scale_weight"] = quantise_scaled_fp8(official[key])
    save_file(scaled, str(tmp_path / "animate_fp8_scaled.safetensors"))
    transformer = _load_with_file(base, tmp_path / "animate_fp8_scaled.safetensors").transformer
    reference = folder_models["wan2.2-animate"]
    with torch.no_grad():
        expected = reference(**_animate_inputs(reference)).sample
        got = transformer(**_animate_inputs(transformer)).sample
    # fp8 weights: close, not equal; a dropped or misplaced tensor (to_k / to_v swapped) is far off
    assert (got - expected).abs().max() < 0.1 * expected.abs().max()


def test_a_tensor_the_map_does_not_know_is_named_not_dropped(tiny_model, tmp_path):
    base = tiny_model("wan2.2-animate")
    official = diffusers_to_official(_state(base))
    official["face_adapter.fuser_blocks.0.linear3.weight"] = torch.zeros(4, 4)
    save_file(official, str(tmp_path / "animate.safetensors"))
    with pytest.raises(ModelLoadError, match="face_adapter.fuser_blocks.0.linear3.weight"):
        _load_with_file(base, tmp_path / "animate.safetensors")


def test_a_motion_encoder_with_another_blur_filter_is_refused(tiny_model, tmp_path):
    base = tiny_model("wan2.2-animate")
    official = diffusers_to_official(_state(base))
    official["motion_encoder.enc.net_app.convs.1.conv2.0.kernel"] = torch.full((4, 4), 1 / 16)
    save_file(official, str(tmp_path / "animate.safetensors"))
    with pytest.raises(ModelLoadError, match="blur kernels"):
        _load_with_file(base, tmp_path / "animate.safetensors")


def test_official_animate_2_file_computes_what_the_folder_computes(tiny_model, folder_models, tmp_path):
    base = tiny_model("wan2.2-animate-2")
    official = {COMFY_PREFIX + k: v for k, v in diffusers_to_official(_state(base), animate_2=True).items()}
    assert "model.diffusion_model.blocks.0.block.self_attn.q.weight" in official
    save_file(official, str(tmp_path / "Wan2_2-Animate-2.safetensors"))
    loaded = _load_with_file(base, tmp_path / "Wan2_2-Animate-2.safetensors")
    assert loaded.variant is WanVariant.ANIMATE_2_14B
    assert isinstance(loaded.transformer, WanAnimate2Transformer3DModel)
    with torch.no_grad():
        expected = _animate_2_run(folder_models["wan2.2-animate-2"])
        got = _animate_2_run(loaded.transformer)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_release_folder_of_official_animate_files_is_recognised(tiny_model, tmp_path):
    """An official-style folder (no model_index.json): the transformer's tensors decide the variant."""
    base = tiny_model("wan2.2-animate")
    release = tmp_path / "Wan2.2-Animate-14B"
    release.mkdir()
    save_file(diffusers_to_official(_state(base)), str(release / "diffusion_pytorch_model.safetensors"))
    # the official config.json (wan/modules/animate/model_animate.py's register_to_config): the head count
    (release / "config.json").write_text(json.dumps({"_class_name": "WanAnimateModel", "dim": 64, "num_heads": 2}))
    for part in ("vae", "text_encoder", "image_encoder"):
        shutil.copytree(base / part, release / part)
    shutil.copytree(base / "tokenizer", release / "tokenizer")
    config = ModelConfig(base_model_name=str(release))
    config.tokenizer.path = str(release / "tokenizer")
    plan = plan_model(config)
    assert plan.variant is WanVariant.ANIMATE_14B
    assert plan.model_index["_class_name"] == "WanAnimatePipeline"
    assert plan.scheduler_config["flow_shift"] == 5.0
