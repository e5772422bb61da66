"""The tiny random Wan models are real diffusers folders that diffusers' own Wan pipelines load and run offline."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from modules.util.tiny_models import CLIP_HIDDEN, CLIP_TOKENS, SPECS, VARIANTS
from modules.util.tiny_pipelines import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent
FRAMES = 9


def pixel_size(variant: str) -> int:
    return 64 if SPECS[variant].z_dim == 48 else 32   # one 2x2 patch of latents is 32 px for the 48-ch VAE


def make_image(size: int, flip: bool = False) -> Image.Image:
    ys, xs = np.mgrid[0:size, 0:size]
    pixels = np.stack([xs * 255 // size, ys * 255 // size, np.full_like(xs, 200)], axis=-1).astype(np.uint8)
    image = Image.fromarray(pixels)
    return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if flip else image


def load_pipeline(folder: Path, cls=None):
    from diffusers import DiffusionPipeline

    pipeline = (cls or DiffusionPipeline).from_pretrained(folder)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_folder_configs_match_the_released_layout(tiny_model, variant):
    folder = tiny_model(variant)
    spec = SPECS[variant]
    index = read_json(folder / "model_index.json")
    transformer = read_json(folder / "transformer" / "config.json")
    vae = read_json(folder / "vae" / "config.json")
    scheduler = read_json(folder / "scheduler" / "scheduler_config.json")

    assert index["_class_name"] == spec.pipeline_class
    assert index["tokenizer"] == ["transformers", "T5TokenizerFast"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert index["boundary_ratio"] == spec.boundary_ratio
    assert index.get("expand_timesteps", False) is spec.expand_timesteps   # WanVACEPipeline has no such field
    assert (index["transformer_2"][0] is not None) is spec.two_experts
    assert (folder / "transformer_2").is_dir() is spec.two_experts
    if spec.pipeline_class == "WanImageToVideoPipeline":
        has_clip = index["image_encoder"][0] is not None
        assert has_clip is spec.image_branch
        if has_clip:
            assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]

    assert transformer["in_channels"] == spec.in_channels
    assert transformer["out_channels"] == vae["z_dim"] == spec.z_dim
    assert transformer["text_dim"] == read_json(folder / "text_encoder" / "config.json")["d_model"]
    assert transformer["qk_norm"] == "rms_norm_across_heads" and transformer["cross_attn_norm"] is True
    assert tuple(transformer["patch_size"]) == (1, 2, 2)
    assert transformer["image_dim"] == (CLIP_HIDDEN if spec.image_branch else None)
    assert transformer["pos_embed_seq_len"] == (2 * CLIP_TOKENS if spec.flf2v else None)
    assert (transformer["_class_name"] == "WanVACETransformer3DModel") is spec.vace
    if spec.vace:   # one base block per VACE block, 0 first, every second block (ComfyUI's spacing for 2 of 4)
        assert transformer["vace_layers"] == [0, 2] and transformer["vace_in_channels"] == 96
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == spec.z_dim
    assert vae["scale_factor_spatial"] == (16 if spec.z_dim == 48 else 8)
    assert vae["is_residual"] is (spec.z_dim == 48)
    assert scheduler["_class_name"] == "UniPCMultistepScheduler"
    assert scheduler["prediction_type"] == "flow_prediction" and scheduler["use_flow_sigmas"] is True
    assert scheduler["flow_shift"] == spec.flow_shift


# Wan-Fun Control has no diffusers pipeline of its own (its sampler: tests/test_fun_control.py)
@pytest.mark.parametrize("variant", [v for v in VARIANTS if "fun-control" not in v])
def test_diffusers_pipeline_loads_offline_and_runs(tiny_model, variant):
    spec = SPECS[variant]
    pipeline = load_pipeline(tiny_model(variant))
    assert type(pipeline).__name__ == spec.pipeline_class

    expert_calls = {"transformer": 0, "transformer_2": 0}
    for name in expert_calls:
        module = getattr(pipeline, name, None)
        if module is not None:
            module.register_forward_hook(lambda *_, name=name: expert_calls.__setitem__(name, expert_calls[name] + 1))

    size = pixel_size(variant)
    kwargs = dict(prompt="a red square moving left", negative_prompt="blurry", height=size, width=size,
                  num_frames=FRAMES, num_inference_steps=2, guidance_scale=5.0, output_type="np",
                  generator=torch.Generator().manual_seed(0))
    if spec.pipeline_class == "WanImageToVideoPipeline":
        kwargs["image"] = make_image(size)
        if spec.flf2v:
            kwargs["last_image"] = make_image(size, flip=True)
    video = pipeline(**kwargs).frames

    assert video.shape == (1, FRAMES, size, size, 3)
    assert np.isfinite(video).all()
    # 2 steps with classifier-free guidance; with flow shift 3 the second timestep (750) is below both A14B
    # boundaries (875, 900), so each expert denoises one step
    if spec.two_experts:
        assert expert_calls == {"transformer": 2, "transformer_2": 2}
    else:
        assert expert_calls == {"transformer": 4, "transformer_2": 0}
    if variant == "wan2.2-i2v-a14b":
        assert pipeline.image_encoder is None and pipeline.transformer.config.image_dim is None


def test_ti2v_5b_does_image_to_video_through_the_i2v_pipeline(tiny_model):
    """TI2V-5B ships as a WanPipeline; diffusers does its image-to-video with WanImageToVideoPipeline on the same
    folder (no CLIP, expand_timesteps): the first latent frame is the encoded image, the rest is denoised."""
    from diffusers import WanImageToVideoPipeline

    pipeline = load_pipeline(tiny_model("wan2.2-ti2v-5b"), WanImageToVideoPipeline)
    assert pipeline.config.expand_timesteps is True and pipeline.image_encoder is None

    def run(seed: int) -> torch.Tensor:
        return pipeline(image=make_image(64), prompt="a red square", height=64, width=64, num_frames=FRAMES,
                        num_inference_steps=2, guidance_scale=1.0, output_type="latent",
                        generator=torch.Generator().manual_seed(seed)).frames

    first, second = run(0), run(1)
    assert first.shape == (1, 48, 3, 2 * 2, 2 * 2)
    assert torch.isfinite(first).all()
    assert torch.equal(first[:, :, 0], second[:, :, 0])
    assert not torch.equal(first[:, :, 1:], second[:, :, 1:])


def test_tokenizer_is_a_t5_tokenizer_padding_to_512(tiny_model):
    from transformers import AutoTokenizer

    folder = tiny_model("wan2.1-t2v")
    tokenizer = AutoTokenizer.from_pretrained(folder / "tokenizer")
    assert type(tokenizer).__name__ in ("T5TokenizerFast", "T5Tokenizer")   # one class under transformers 5
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id) == (0, 1, 2)
    assert len(tokenizer) == read_json(folder / "text_encoder" / "config.json")["vocab_size"]

    for word in ("a", "the", "of", "video", "square", "moving", "red", "green", "blue", "yellow",
                 "left", "right", "up", "down"):
        assert tokenizer.tokenize(word) == ["▁" + word]
    assert tokenizer.unk_token_id not in tokenizer("A Zebra, 42!").input_ids

    batch = tokenizer(["a red square moving left", "a blue square moving up " * 300], padding="max_length",
                      max_length=512, truncation=True, add_special_tokens=True, return_attention_mask=True,
                      return_tensors="pt")
    assert batch.input_ids.shape == (2, 512)
    ids, mask = batch.input_ids[0], batch.attention_mask[0]
    length = int(mask.sum())
    assert ids[:length].tolist() == tokenizer("a red square moving left").input_ids
    assert ids[length - 1] == 1 and (ids[length:] == 0).all()
    assert batch.attention_mask[1].all()


def test_same_seed_gives_identical_folders_and_another_seed_differs(tiny_model, tmp_path):
    reference = tiny_model("wan2.1-flf2v")
    again = make_tiny_model("wan2.1-flf2v", tmp_path / "again", seed=0)
    other = make_tiny_model("wan2.1-flf2v", tmp_path / "other", seed=1)

    files = sorted(path.relative_to(reference) for path in reference.rglob("*") if path.is_file())
    assert files == sorted(path.relative_to(again) for path in again.rglob("*") if path.is_file())
    for name in files:
        assert (reference / name).read_bytes() == (again / name).read_bytes(), name

    from safetensors.torch import load_file

    weights = [name for name in files if name.suffix == ".safetensors"]
    assert len(weights) == 4   # text_encoder, image_encoder, vae, transformer
    for name in weights:
        ours, theirs = load_file(reference / name), load_file(other / name)
        assert ours.keys() == theirs.keys()
        assert any(not torch.equal(ours[key], theirs[key]) for key in ours), name
    tokenizer = Path("tokenizer") / "tokenizer.json"   # the tokenizer does not depend on the seed
    assert (reference / tokenizer).read_bytes() == (other / tokenizer).read_bytes()


def test_two_experts_are_different_models(tiny_model):
    from safetensors.torch import load_file

    folder = tiny_model("wan2.2-t2v-a14b")
    high = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    low = load_file(folder / "transformer_2" / "diffusion_pytorch_model.safetensors")
    assert high.keys() == low.keys()
    assert not torch.equal(high["proj_out.weight"], low["proj_out.weight"])


def test_normalised_latents_are_near_unit_scale(tiny_model):
    """latents_mean/std are calibrated for the random VAE, so (z - mean) / std is O(1) as with the real models."""
    from diffusers import AutoencoderKLWan

    for variant in ("wan2.1-t2v", "wan2.2-ti2v-5b"):
        vae = AutoencoderKLWan.from_pretrained(tiny_model(variant) / "vae")
        size = pixel_size(variant)
        video = torch.from_numpy(np.asarray(make_image(size), dtype=np.float32) / 127.5 - 1).permute(2, 0, 1)
        video = video[:, None].repeat(1, 5, 1, 1)[None]
        with torch.no_grad():
            latents = vae.encode(video).latent_dist.mode()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        normalised = (latents - mean) / std
        assert 0.1 < normalised.std().item() < 10 and normalised.abs().mean().item() < 10


def test_refuses_to_replace_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_tiny_model("wan2.1-t2v", tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"
    with pytest.raises(ValueError, match="unknown tiny Wan variant"):
        make_tiny_model("wan9-t2v", tmp_path / "new")


def test_script_writes_a_loadable_folder(tmp_path):
    output = tmp_path / "cli"
    result = subprocess.run([sys.executable, "scripts/make_tiny_model.py", "--variant", "wan2.2-i2v-a14b",
                             "--output", str(output), "--seed", "3"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(output)
    index = read_json(output / "model_index.json")
    assert index["_class_name"] == "WanImageToVideoPipeline" and index["boundary_ratio"] == 0.9
    # building over an existing model folder replaces it whole (no stale parts of the previous variant)
    make_tiny_model("wan2.1-t2v", output)
    assert not (output / "transformer_2").exists()
    assert read_json(output / "model_index.json")["_class_name"] == "WanPipeline"
