"""Sampling a VACE model: our sampler (control video, mask, reference image, control scale read from files) gives the
latents diffusers' `WanVACEPipeline` gives for the same inputs, seed and steps; bad inputs are named."""
import json

import numpy as np
import pytest
import torch
from PIL import Image

from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
from modules.modelSampler.WanModelSampler import SampleError, WanModelSampler
from modules.modelSampler.vace_sampling import VaceInputError, check_vace_sample, load_vace_inputs
from modules.util.config.ModelConfig import ModelConfig
from modules.util.config.SampleConfig import SampleConfig
from modules.util.enum.WanVariant import WanVariant
from modules.util.video_frames import write_video

FRAMES, HEIGHT, WIDTH = 9, 32, 48


@pytest.fixture(scope="module")
def vace_model(tiny_model):
    return WanBaseModelLoader().load(ModelConfig(base_model_name=str(tiny_model("wan2.1-vace"))))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A control frames folder (lossless PNGs), a mask frames folder (white, black and greys), one reference image."""
    root = tmp_path_factory.mktemp("vace-inputs")
    rng = np.random.default_rng(0)
    control = rng.integers(0, 256, (FRAMES, HEIGHT // 8, WIDTH // 8, 3)).astype(np.uint8).repeat(8, 1).repeat(8, 2)
    mask = np.zeros((FRAMES, HEIGHT, WIDTH, 3), np.uint8)
    mask[:, 8:24, 8:32] = 255
    # grey, as a soft edge or compression leaves it: kept in the mask channels by the official code and by diffusers.
    # Only grey (R = G = B): on a coloured mask diffusers splits the control by each colour channel, the official
    # code (which ours follows: test_official_conditioning.py) by the red one
    mask[:, :8] = np.linspace(0, 255, WIDTH).round().astype(np.uint8)[None, None, :, None]
    mask[:, 24:, :8], mask[:, 24:, 32:] = 77, 178
    for name, frames in (("clip_control", control), ("clip_mask", mask)):
        (root / name).mkdir()
        for index, frame in enumerate(frames):
            Image.fromarray(frame).save(root / name / f"{index:03d}.png")
    reference = Image.fromarray(rng.integers(0, 256, (24, 16, 3), dtype=np.uint8))
    reference.save(root / "clip_ref.png")
    return root, control, mask, reference


def _sample(root, **changes) -> SampleConfig:
    values = dict(prompt="a red square moving left", width=WIDTH, height=HEIGHT, frames=FRAMES, steps=2,
                  guidance=2.0, seed=3, control_video=str(root / "clip_control"), mask_video=str(root / "clip_mask"),
                  reference_images=[str(root / "clip_ref.png")], control_scale=0.8)
    return SampleConfig(**{**values, **changes})


def test_our_sampler_equals_wan_vace_pipeline(vace_model, inputs):
    root, control, mask, reference = inputs
    sample = _sample(root)
    ours = WanModelSampler(vace_model, device="cpu").sample(sample)
    pipeline = vace_model.create_pipeline()
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        theirs = pipeline(prompt=sample.prompt, negative_prompt=sample.effective_negative_prompt,
                          video=[Image.fromarray(frame) for frame in control],
                          mask=[Image.fromarray(frame) for frame in mask], reference_images=[reference],
                          conditioning_scale=0.8, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=2,
                          guidance_scale=2.0, generator=torch.Generator().manual_seed(3), output_type="latent").frames
    assert ours.latents.shape == (16, (FRAMES - 1) // 4 + 1, HEIGHT // 8, WIDTH // 8)
    torch.testing.assert_close(ours.latents, theirs[0, :, 1:].float(), atol=1e-5, rtol=0)   # the reference frame cut
    assert ours.frames.shape == (FRAMES, HEIGHT, WIDTH, 3)
    weaker = WanModelSampler(vace_model, device="cpu").sample(_sample(root, control_scale=0.0))
    assert (weaker.latents - ours.latents).abs().max() > 1e-2   # the control changes the result


def test_bad_inputs_are_named(vace_model, inputs, tmp_path):
    root, control, _, _ = inputs
    short = tmp_path / "short_control.mp4"
    write_video(short, control[:5], fps=16)
    sampler = WanModelSampler(vace_model, device="cpu")
    with pytest.raises(SampleError, match=r"control video '.*short_control\.mp4' has 5 frames; the sample has 9"):
        sampler.sample(_sample(root, control_video=str(short)))
    with pytest.raises(SampleError, match=r"reference image '.*short_control\.mp4' is not an image"):
        sampler.sample(_sample(root, reference_images=[str(short)]))
    with pytest.raises(VaceInputError, match="control_video, reference_images need a VACE or Wan-Fun Control model; T2V takes none"):
        check_vace_sample(WanVariant.T2V, _sample(root, mask_video=""))
    with pytest.raises(SampleError, match="a VACE model takes no image"):
        sampler.resolve(_sample(root, image=str(root / "clip_ref.png")))


def test_a_mask_of_another_aspect_than_the_control_is_named(inputs, tmp_path):
    """Control and mask are each cropped to the sample's size: a mask of another aspect ratio would mark another
    region than its pixels show, so it is refused naming both sizes; one of the same aspect at another size is
    scaled as the control is."""
    root, _, mask, _ = inputs
    for name, size in (("square_mask", (HEIGHT, HEIGHT)), ("double_mask", (2 * HEIGHT, 2 * WIDTH))):
        (tmp_path / name).mkdir()
        for index, frame in enumerate(mask):
            Image.fromarray(frame).resize(size[::-1], Image.NEAREST).save(tmp_path / name / f"{index:03d}.png")
    with pytest.raises(VaceInputError, match=rf"mask video '.*square_mask' is {HEIGHT}x{HEIGHT}, the control video "
                                             rf"{WIDTH}x{HEIGHT}; a mask must have the control's aspect ratio"):
        load_vace_inputs(str(root / "clip_control"), str(tmp_path / "square_mask"), [], FRAMES, HEIGHT, WIDTH)
    _, scaled, _ = load_vace_inputs(str(root / "clip_control"), str(tmp_path / "double_mask"), [], FRAMES, HEIGHT,
                                    WIDTH)
    _, own, _ = load_vace_inputs(str(root / "clip_control"), str(root / "clip_mask"), [], FRAMES, HEIGHT, WIDTH)
    assert torch.equal(scaled, own)


def test_sample_py_names_every_control_problem_before_any_model_loads(inputs, tmp_path, capsys, monkeypatch):
    """A too short control, a mask that is no video and references that are no images are all named at once, from
    the files alone: the base model named does not exist and the loader would fail the test if it were called."""
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from tests.script_loader import load_script

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the control inputs were checked")

    monkeypatch.setattr(WanBaseModelLoader, "load", no_load)
    root, _, _, _ = inputs
    (tmp_path / "notes.txt").write_text("not a mask")
    code = load_script("sample").main([
        "--base-model-name", str(tmp_path / "no_such_model"), "--prompt", "x", "--width", str(WIDTH),
        "--height", str(HEIGHT), "--frames", "12", "--steps", "1", "--device", "cpu",   # 12 frames run as 13
        "--control-video", str(root / "clip_control"), "--mask-video", str(tmp_path / "notes.txt"),
        "--reference-image", str(root / "clip_control"), "--reference-image", str(tmp_path / "gone.png"),
        "--image", str(tmp_path / "first.png"), "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and "5 problem(s) with the samples' files" in err
    assert f"control video {str(root / 'clip_control')!r} has 9 frames; the sample has 13" in err
    assert f"mask video {str(tmp_path / 'notes.txt')!r} is not a video or a folder of frames (or one image" in err
    assert f"reference image {str(root / 'clip_control')!r} does not exist (or is not a file)" in err
    assert f"reference image {str(tmp_path / 'gone.png')!r} does not exist" in err
    assert f"image {str(tmp_path / 'first.png')!r} does not exist (or is not a file)" in err
    assert not (tmp_path / "out").exists()


def test_sample_py_refuses_inputs_the_variant_cannot_take_before_loading(inputs, tiny_model, tmp_path, capsys,
                                                                         monkeypatch):
    """The variant comes from the folder's configs: a control video for a T2V model (and a second sample's image) is
    named before any weights load."""
    from modules.modelLoader.wan.WanBaseModelLoader import WanBaseModelLoader
    from tests.script_loader import load_script

    def no_load(*args, **kwargs):
        raise AssertionError("a model loaded before the samples were checked against the variant")

    monkeypatch.setattr(WanBaseModelLoader, "load", no_load)
    root, _, _, _ = inputs
    samples = tmp_path / "samples.json"
    samples.write_text(json.dumps([{"prompt": "steered", "control_video": str(root / "clip_control")},
                                   {"prompt": "started", "image": str(root / "clip_ref.png")}]))
    code = load_script("sample").main([
        "--base-model-name", str(tiny_model("wan2.1-t2v")), "--samples-file", str(samples), "--width", str(WIDTH),
        "--height", str(HEIGHT), "--frames", str(FRAMES), "--steps", "1", "--device", "cpu",
        "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1 and "2 sample(s) that T2V cannot take" in err, err
    assert "sample 'steered': control_video need a VACE or Wan-Fun Control model; T2V takes none" in err
    assert "sample 'started': T2V is a text-to-video model and takes no image" in err
