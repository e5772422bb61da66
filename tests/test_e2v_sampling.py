"""E2V sampling (DESIGN.md 6.11): WanModelSampler with an E2V config, WanE2VPipeline, scripts/sample.py.

The E2V model is the tiny Wan 2.1 T2V model expanded for E2V (20 condition channels, an image branch the size of the
tiny I2V model's CLIP) with the tiny I2V model's CLIP image encoder. The expansion's zero-initialised weights (the
new patch-embedding channels, add_v_proj) are randomised under a fixed seed so that the condition and the image
tokens change the video.

"It matches": our sampler's video equals diffusers' plain WanImageToVideoPipeline (loaded from the saved folder)
whose only change is the condition: the mini-video, its mask and the CLIP tokens are computed in this file straight
from the VAE / CLIP and the DESIGN rules, never with modules/model/e2v_condition.py.
"""
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline
from PIL import Image

from modules.model.e2v_condition import clip_tokens, element_to_tensor, make_e2v_condition, preprocess_element
from modules.model.e2v_expansion import expand_t2v_for_e2v
from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.WanE2VPipeline import WanE2VPipeline
from modules.modelSampler.WanModelSampler import SampleError, WanModelSampler
from modules.modelSaver.wan.WanBaseModelSaver import WanBaseModelSaver
from modules.util.config.E2VConfig import load_e2v_dataset_configs
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import WAN_DEFAULT_NEGATIVE_PROMPT, SampleConfig
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.enum.WanVariant import WanVariant
from modules.util.tiny_models import CLIP_HIDDEN, CLIP_TOKENS

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "a red square moving left"
SIDE, FRAMES = 32, 13            # 13 pixel frames -> 4 latent frames of 4 x 4
N_REF = 9                        # repeats 1 + 4 + 4
ATOL = 2e-5
NAMES = ("person", "object", "background")   # positions 0, 1, 2


def load(folder):
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(folder)))


def dataset_config(**changes) -> dict:
    """seed 000's nested form; the elements are listed out of position order on purpose."""
    config = {"data_root": "unused", "target_resolution": [480, 832], "elements": [
        {"name": "background", "suffixes": ["_background.png"], "vae": {"repeat": 4, "position": 2}},
        {"name": "person", "suffixes": ["_person.png"], "required": True, "vae": {"repeat": 1, "position": 0}},
        {"name": "object", "suffixes": ["_object.png"], "vae": {"repeat": 4, "position": 1}}],
        "processors": {"vae": {"default_preprocess": "resize"},
                       "clip": {"resolution": [SIDE, SIDE], "default_preprocess": "resize"}}}
    config.update(changes)
    return config


def e2v_config(**changes):
    return load_e2v_dataset_configs(dataset_config(**changes))[0]


@pytest.fixture(scope="module")
def e2v_model(tiny_model):
    model = load(tiny_model("wan2.1-t2v"))
    donor = load(tiny_model("wan2.1-i2v"))
    model.transformer = expand_t2v_for_e2v(model.transformer, 20, donor.image_encoder.config.hidden_size)
    model.image_encoder, model.image_processor = donor.image_encoder, donor.image_processor
    # as modules/model/e2v_model.py's prepare_e2v_model leaves it: an I2V-architecture model
    model.variant = WanVariant.I2V
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        weight = model.transformer.patch_embedding.weight
        weight[:, 16:] = torch.randn(weight[:, 16:].shape, generator=generator) * weight[:, :16].std()
        for block in model.transformer.blocks:
            projection = block.attn2.add_v_proj
            projection.weight.copy_(torch.randn(projection.weight.shape, generator=generator) * 0.2)
            projection.bias.copy_(torch.randn(projection.bias.shape, generator=generator) * 0.2)
    return model


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> dict[str, Path]:
    """Per name: a SIDE x SIDE image (no resizing needed anywhere), plus 'other' and a non-square 'wide' one."""
    folder = tmp_path_factory.mktemp("elements")
    rng = np.random.default_rng(0)
    paths = {}
    for index, name in enumerate(NAMES + ("other", "wide")):
        shape = (24, 40, 3) if name == "wide" else (SIDE, SIDE, 3)
        pixels = (rng.random(shape) * 60).astype(np.uint8) + np.uint8(40 * index)
        pixels[4:14, 6:20] = ((200, 40, 40), (40, 200, 40), (40, 40, 200), (220, 220, 30), (30, 220, 220))[index]
        Image.fromarray(pixels).save(folder / f"{name}.png")
        paths[name] = folder / f"{name}.png"
    return paths


def sample_with(pictures, names=NAMES, **overrides) -> SampleConfig:
    values = dict(prompt=PROMPT, width=SIDE, height=SIDE, frames=FRAMES, steps=2, guidance=4.0, seed=7,
                  elements={name: str(pictures[name]) for name in names})
    values.update(overrides)
    return SampleConfig(**values)


@contextmanager
def transformer_inputs(model):
    """What every transformer forward receives: the condition channels of hidden_states, the text and image tokens."""
    seen = []

    def hook(module, args, kwargs):
        image = kwargs.get("encoder_hidden_states_image")
        seen.append({"condition": kwargs["hidden_states"][:, 16:].clone(), "text": kwargs["encoder_hidden_states"],
                     "image": None if image is None else image.clone()})

    handle = model.transformer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


# --- the expected condition and tokens, from the DESIGN rules ----------------------------------------------------

def pixels(path) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(path).convert("RGB"))).permute(2, 0, 1).float() / 127.5 - 1


@torch.no_grad()
def expected_condition(model, paths: list) -> torch.Tensor:
    """(1, 20, T, h, w): slot k = paths[k] (None: empty) over repeats 1, 4, 4; grey (0) elsewhere; VAE mean,
    (z - mean) / std; mask ones on the latent frames of the present slots."""
    video = torch.zeros(1, 3, FRAMES, SIDE, SIDE)
    mask = torch.zeros(1, 4, 4, SIDE // 8, SIDE // 8)
    for slot, (path, frames) in enumerate(zip(paths, ([0], [1, 2, 3, 4], [5, 6, 7, 8]))):
        if path is not None:
            video[0, :, frames] = pixels(path)[:, None]
            mask[:, :, slot] = 1
    latents = model.vae.encode(video).latent_dist.mode()
    mean = torch.tensor(model.vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(model.vae.config.latents_std).view(1, -1, 1, 1, 1)
    return torch.cat([mask, (latents - mean) / std], dim=1)


@torch.no_grad()
def expected_tokens(model, paths: list) -> torch.Tensor:
    """(1, N * 17, dim): CLIP hidden_states[-2] of each image, concatenated in the given order."""
    images = [Image.open(path).convert("RGB") for path in paths]
    pixel_values = model.image_processor(images=images, return_tensors="pt").pixel_values
    hidden = model.image_encoder(pixel_values=pixel_values, output_hidden_states=True).hidden_states[-2]
    return hidden.reshape(1, -1, hidden.shape[-1])


class ConditionSwappedPipeline(WanImageToVideoPipeline):
    """diffusers' I2V pipeline, unchanged but for the condition: its own prepare_latents draws the noise (and
    encodes the placeholder image), then the condition is replaced; the image tokens are CLIP's tokens of the
    element images, through diffusers' own encode_image."""
    condition: torch.Tensor
    element_images: list

    def prepare_latents(self, *args, **kwargs):
        latents, _ = super().prepare_latents(*args, **kwargs)
        return latents, self.condition.to(latents)

    def encode_image(self, image, device=None):
        tokens = super().encode_image(self.element_images, device)
        return tokens.reshape(1, -1, tokens.shape[-1])


# --- tests -------------------------------------------------------------------------------------------------------

def test_matches_i2v_pipeline_with_swapped_condition(e2v_model, pictures, tmp_path):
    folder = tmp_path / "e2v"
    WanBaseModelSaver().save(e2v_model, ModelFormat.DIFFUSERS, folder)
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == ["transformers", "CLIPVisionModel"] and index["image_processor"][0]

    sample = sample_with(pictures)
    sampler = WanModelSampler(e2v_model, e2v_config=e2v_config())
    with transformer_inputs(e2v_model) as seen:
        ours = sampler.sample(sample)
    condition = expected_condition(e2v_model, [pictures[name] for name in NAMES])
    tokens = expected_tokens(e2v_model, [pictures[name] for name in NAMES])
    assert tokens.shape == (1, 3 * CLIP_TOKENS, CLIP_HIDDEN)
    assert len(seen) == 4  # 2 steps x (cond, uncond)
    for inputs in seen:
        torch.testing.assert_close(inputs["condition"], condition, atol=1e-5, rtol=0)
        torch.testing.assert_close(inputs["image"], tokens, atol=1e-5, rtol=0)
        assert inputs["text"].shape[1] == 512

    reference = ConditionSwappedPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    reference.condition = condition
    reference.element_images = [Image.open(pictures[name]).convert("RGB") for name in NAMES]
    frames = reference(image=Image.new("RGB", (SIDE, SIDE)), prompt=PROMPT, negative_prompt=WAN_DEFAULT_NEGATIVE_PROMPT,
                       height=SIDE, width=SIDE, num_frames=FRAMES, num_inference_steps=2, guidance_scale=4.0,
                       generator=torch.Generator().manual_seed(7)).frames[0]
    assert ours.frames.shape == frames.shape == (FRAMES, SIDE, SIDE, 3)
    assert ours.frames.std() > 0.01
    np.testing.assert_allclose(ours.frames, frames, atol=ATOL, rtol=0)


def test_elements_change_condition_and_tokens(e2v_model, pictures):
    sampler = WanModelSampler(e2v_model, e2v_config=e2v_config())
    runs = {}
    for label, elements in (("all", dict(zip(NAMES, NAMES))),
                            ("other", {"person": "person", "object": "other", "background": "background"}),
                            ("no object", {"person": "person", "background": "background"})):
        sample = sample_with(pictures, elements={name: str(pictures[p]) for name, p in elements.items()})
        with transformer_inputs(e2v_model) as seen:
            video = sampler.sample(sample).frames
        runs[label] = (seen[0]["condition"], seen[0]["image"], video)
    condition, tokens, video = runs["all"]
    # another object image: the condition (from its slot on) and the tokens differ, and so does the video
    other_condition, other_tokens, other_video = runs["other"]
    assert torch.equal(other_condition[:, :, :1], condition[:, :, :1])       # slot 0 precedes the change
    assert (other_condition[:, 4:, 1] - condition[:, 4:, 1]).abs().max() > 1e-2
    assert (other_tokens[:, CLIP_TOKENS:2 * CLIP_TOKENS] - tokens[:, CLIP_TOKENS:2 * CLIP_TOKENS]).abs().max() > 1e-3
    torch.testing.assert_close(other_tokens[:, :CLIP_TOKENS], tokens[:, :CLIP_TOKENS])
    assert np.abs(other_video - video).max() > 1e-2
    # the optional object missing: its slot stays empty (grey, mask 0), the background keeps slot 2
    missing_condition, missing_tokens, _ = runs["no object"]
    expected = expected_condition(e2v_model, [pictures["person"], None, pictures["background"]])
    torch.testing.assert_close(missing_condition, expected, atol=1e-5, rtol=0)
    assert missing_condition[0, :4, :, 0, 0].T.tolist() == [[1.0] * 4, [0.0] * 4, [1.0] * 4, [0.0] * 4]
    # CLIP tokens: N x 17, in position order (the config lists background first)
    assert missing_tokens.shape == (1, 2 * CLIP_TOKENS, CLIP_HIDDEN)
    torch.testing.assert_close(missing_tokens, expected_tokens(e2v_model, [pictures["person"], pictures["background"]]),
                               atol=1e-5, rtol=0)


def test_preprocessing_as_training(e2v_model, pictures):
    """A non-square element: VAE side at the sample's size with its vae preprocess, CLIP side at
    processors.clip.resolution with its clip preprocess, as the data loader does."""
    raw = dataset_config()
    raw["elements"][2]["vae"]["preprocess"] = "pad_white"       # object
    raw["elements"][2]["clip"] = {"preprocess": "letterbox"}
    raw["processors"]["clip"]["resolution"] = [24, 40]
    config = load_e2v_dataset_configs(raw)[0]
    elements = {"person": str(pictures["person"]), "object": str(pictures["wide"])}
    with transformer_inputs(e2v_model) as seen:
        WanModelSampler(e2v_model, e2v_config=config).sample(sample_with(pictures, elements=elements, steps=1,
                                                                         guidance=1.0))
    wide = np.array(Image.open(pictures["wide"]).convert("RGB"))
    person = np.array(Image.open(pictures["person"]).convert("RGB"))
    vae_elements = [element_to_tensor(person), element_to_tensor(preprocess_element(wide, SIDE, SIDE, "pad_white")),
                    None]
    condition = make_e2v_condition(e2v_model, vae_elements, [1, 4, 4], FRAMES)
    torch.testing.assert_close(seen[0]["condition"][0], condition, atol=1e-5, rtol=0)
    tokens = clip_tokens(e2v_model, [preprocess_element(person, 24, 40, "resize"),
                                     preprocess_element(wide, 24, 40, "letterbox")])
    torch.testing.assert_close(seen[0]["image"][0], tokens, atol=1e-5, rtol=0)


def test_one_element(e2v_model, pictures):
    """SkyReels-A2's released pipeline breaks with exactly one reference; ours takes 1..N."""
    config = load_e2v_dataset_configs({"data_root": "x", "target_resolution": [SIDE, SIDE], "elements": [
        {"name": "person", "suffixes": ["_person.png"], "vae_repeat": 1, "position": 0, "clip_process": "resize"}]})[0]
    with transformer_inputs(e2v_model) as seen:
        result = WanModelSampler(e2v_model, e2v_config=config).sample(
            sample_with(pictures, names=("person",), frames=5, drop_reference_frames=True))
    assert result.frames.shape == (4, SIDE, SIDE, 3)
    mask = seen[0]["condition"][0, :4, :, 0, 0]
    assert mask.T.tolist() == [[1.0] * 4, [0.0] * 4]
    assert seen[0]["image"].shape == (1, CLIP_TOKENS, CLIP_HIDDEN)


def test_drop_reference_frames(e2v_model, pictures):
    sampler = WanModelSampler(e2v_model, e2v_config=e2v_config())
    full = sampler.sample(sample_with(pictures)).frames
    dropped = sampler.sample(sample_with(pictures, drop_reference_frames=True)).frames
    assert dropped.shape == (FRAMES - N_REF, SIDE, SIDE, 3)
    np.testing.assert_array_equal(dropped, full[N_REF:])
    # an absent trailing element's slot is still in the target (grey frames): still 1 + 4 + 4 dropped
    two = sampler.sample(sample_with(pictures, names=("person", "object"), drop_reference_frames=True, steps=1))
    assert two.frames.shape[0] == FRAMES - N_REF
    # reference_frames 'overlay': the video has no leading reference frames, nothing is dropped
    overlay = WanModelSampler(e2v_model, e2v_config=e2v_config(reference_frames="overlay")).sample(
        sample_with(pictures, drop_reference_frames=True, steps=1))
    assert overlay.frames.shape[0] == FRAMES and any("nothing to drop" in note for note in overlay.notes)


def test_e2v_types(e2v_model, pictures):
    """clip: the empty condition (mask 0, grey latents) and image tokens; vae: the element condition and no image
    tokens (the image branch sees zero tokens, as in training without encoder_hidden_states_image)."""
    with transformer_inputs(e2v_model) as seen:
        WanModelSampler(e2v_model, e2v_config=e2v_config(e2v_type="clip")).sample(
            sample_with(pictures, steps=1, guidance=1.0))
        WanModelSampler(e2v_model, e2v_config=e2v_config(e2v_type="vae")).sample(
            sample_with(pictures, steps=1, guidance=1.0))
    clip_run, vae_run = seen
    torch.testing.assert_close(clip_run["condition"], expected_condition(e2v_model, [None, None, None]),
                               atol=1e-5, rtol=0)
    assert clip_run["image"].shape == (1, 3 * CLIP_TOKENS, CLIP_HIDDEN)
    torch.testing.assert_close(vae_run["condition"], expected_condition(e2v_model, [pictures[n] for n in NAMES]),
                               atol=1e-5, rtol=0)
    assert vae_run["image"].shape == (1, 0, CLIP_HIDDEN)  # the image branch sees zero tokens
    assert clip_run["text"].shape[1] == vae_run["text"].shape[1] == 512


def test_errors(e2v_model, pictures, tmp_path):
    sampler = WanModelSampler(e2v_model, e2v_config=e2v_config())
    gone = tmp_path / "gone_person.png"
    with pytest.raises(SampleError, match="gone_person.png"):
        sampler.resolve(sample_with(pictures, elements={"person": str(gone)}))
    with pytest.raises(SampleError, match="'hat'.*person, object, background"):
        sampler.resolve(sample_with(pictures, elements={"person": str(pictures["person"]), "hat": str(gone)}))
    with pytest.raises(SampleError, match=r"required element\(s\) \['person'\]"):
        sampler.resolve(sample_with(pictures, names=("object",)))
    with pytest.raises(SampleError, match="remove image"):
        sampler.resolve(sample_with(pictures, image=str(pictures["person"])))
    with pytest.raises(SampleError, match="do not fit"):
        sampler.resolve(sample_with(pictures, frames=5))
    with pytest.raises(SampleError, match="E2V"):
        WanModelSampler(e2v_model).resolve(sample_with(pictures))
    # the pipeline refuses text that is not 512 tokens long for a transformer with an image branch
    pipeline = WanE2VPipeline.from_model(e2v_model)
    with pytest.raises(ValueError, match="512"):
        pipeline(e2v_condition=torch.zeros(20, 4, 4, 4), prompt_embeds=torch.zeros(1, 100, 32), height=SIDE,
                 width=SIDE, num_frames=FRAMES, guidance_scale=1.0)


def test_sample_script_writes_mp4(e2v_model, pictures, tmp_path):
    folder = tmp_path / "e2v"
    WanBaseModelSaver().save(e2v_model, ModelFormat.DIFFUSERS, folder)
    # seed 002's flat form, wrapped in {"datasets": [...]}
    flat = {"datasets": [{"data_root": "unused", "dataset_type": "e2v", "target_resolution": [480, 832],
                          "clip_resolution": [SIDE, SIDE], "vae_combine": "before", "elements": [
                              {"name": "person", "suffixes": ["_person.png"], "vae_repeat": 1, "position": 0,
                               "clip_process": "center_crop"},
                              {"name": "object", "suffixes": ["_object.png"], "vae_repeat": 4, "position": 1,
                               "clip_process": "pad_white"},
                              {"name": "background", "suffixes": ["_background.png"], "vae_repeat": 4,
                               "position": 2, "clip_process": "letterbox"}]}]}
    config_path = tmp_path / "e2v.json"
    config_path.write_text(json.dumps(flat))
    out = tmp_path / "out"
    command = [sys.executable, str(ROOT / "scripts" / "sample.py"), "--base-model-name", str(folder),
               "--e2v-config", str(config_path), "--prompt", PROMPT, "--element", f"person={pictures['person']}",
               "--element", f"background={pictures['background']}", "--drop-reference-frames",
               "--width", str(SIDE), "--height", str(SIDE), "--frames", str(FRAMES), "--steps", "2",
               "--output-dir", str(out), "--device", "cpu"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    printed = [Path(line) for line in result.stdout.splitlines()]
    assert len(printed) == 1 and printed[0].is_file() and printed[0].suffix == ".mp4"
    with av.open(str(printed[0])) as container:
        assert sum(1 for _ in container.decode(video=0)) == FRAMES - N_REF
