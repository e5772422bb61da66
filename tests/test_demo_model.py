"""The built-in demo shows something a newcomer can see: its clips move one way only, its tiny VAE reconstructs the
squares, its base draws them moving, and the demo's LoRA makes them move the way its captions say
(modules/util/demo_model.py)."""
from pathlib import Path

import numpy as np
import pytest
import torch

from modules.util.demo_assets import BACKGROUND, COLOURS, DEMO_SIZE, make_demo_t2v_dataset, square_clip
from modules.util.square_check import caption_square_problems, centre_column, colour_of, deviation
from modules.util.video_io import read_media


def square_columns(frame: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """The columns where the frame's pixels are near `colour`."""
    close = np.abs(frame.astype(int) - np.array(colour)).max(axis=-1) < 40
    return np.nonzero(close.any(axis=0))[0]


def test_the_square_check_tells_moving_squares_from_wrong_ones(squares_dataset):
    """The check accepts every demo clip for its caption and rejects it for the other colour, the other direction,
    a square that stands still and an empty frame."""
    for path in sorted(squares_dataset.glob("*.mp4")):
        colour_name, direction, _ = path.stem.split("_")
        frames = np.asarray(read_media(path))
        other_colour = next(name for name in COLOURS if name != colour_name)
        other_direction = "left" if direction == "right" else "right"
        assert caption_square_problems(frames, colour_name, direction) == [], path.name
        assert caption_square_problems(frames, colour_name) == [], path.name
        assert caption_square_problems(frames, other_colour, direction), path.name
        assert caption_square_problems(frames, colour_name, other_direction), path.name
        assert caption_square_problems(np.repeat(frames[4:5], len(frames), axis=0), colour_name, direction), path.name
        blank = frames.copy()
        blank[3] = BACKGROUND
        assert caption_square_problems(blank, colour_name), path.name


@pytest.mark.parametrize("kind", ["squares", "demo"])
def test_demo_clips_move_only_the_way_their_caption_says(squares_dataset, tmp_path, kind):
    """blue_left_01.mp4 went 20-31, ..., 2-11 and then jumped back to 22-31 in its last frame. The demo's own clips
    (16 x 16, each caption in two shades of its colour) cross the frame by one 8-pixel cell."""
    folder = squares_dataset if kind == "squares" else make_demo_t2v_dataset(tmp_path)
    paths = sorted(folder.glob("*.mp4"))
    assert len(paths) == (24 if kind == "squares" else 12)
    for path in paths:
        colour_name, direction = path.stem.split("_")[:2]
        frames = read_media(path)
        centres = [square_columns(frame, COLOURS[colour_name]).mean() for frame in frames]
        steps = np.diff(centres) * (1 if direction == "right" else -1)
        assert len(frames) == 9 and (steps > 0).all(), (path.name, centres)
        assert abs(centres[-1] - centres[0]) >= frames[0].shape[1] / 2, (path.name, centres)   # it crosses the frame
        if kind == "demo":
            assert frames[0].shape[:2] == (DEMO_SIZE, DEMO_SIZE)


def test_shipped_demo_base_is_what_its_script_describes(tmp_path):
    """resources/demo/demo_base.safetensors (scripts/make_demo_base.py) holds the config `BASE_CONFIG` names, float16
    tensors of the tiny transformer's names and shapes, and the latent statistics of the VAE the demo sets; the demo
    refuses a file trained for other latents, naming the field."""
    import json
    from safetensors import safe_open
    from safetensors.torch import save_file
    from modules.util.demo_model import (BASE_CONFIG, BASE_FILE, DemoBaseError, demo_videos, load_demo_base,
                                         set_latent_stats)
    from modules.util.demo_vae import set_cell_average_weights
    from modules.util.tiny_pipelines import make_tiny_pipeline

    with safe_open(str(BASE_FILE), "pt") as file:
        metadata = file.metadata()
        weights = {name: file.get_tensor(name) for name in file.keys()}
    assert json.loads(metadata["config"]) == BASE_CONFIG
    assert BASE_FILE.stat().st_size < 2 ** 20 and {w.dtype for w in weights.values()} == {torch.float16}
    pipeline = make_tiny_pipeline(BASE_CONFIG["variant"], BASE_CONFIG["seed"])
    assert {k: tuple(w.shape) for k, w in weights.items()} == \
        {k: tuple(w.shape) for k, w in pipeline.transformer.state_dict().items()}
    set_cell_average_weights(pipeline.vae)
    set_latent_stats(pipeline.vae, demo_videos()[0])
    load_demo_base(pipeline.transformer, pipeline.vae)
    assert torch.equal(pipeline.transformer.state_dict()["proj_out.weight"], weights["proj_out.weight"].float())
    bad = {**metadata, "latents_std": json.dumps([1.0] * len(pipeline.vae.config.latents_std))}
    path = tmp_path / "base.safetensors"
    save_file(weights, str(path), bad)
    with pytest.raises(DemoBaseError, match="latents_std.*make_demo_base"):
        load_demo_base(pipeline.transformer, pipeline.vae, path)


@pytest.fixture(scope="module")
def demo_pipeline(demo_model):
    from diffusers import WanPipeline
    return WanPipeline.from_pretrained(demo_model)


@pytest.mark.parametrize("colour_name, direction, offset", [("green", "right", 2), ("blue", "left", 1)])
def test_demo_vae_reconstructs_the_square_in_colour_and_place(demo_pipeline, colour_name, direction, offset):
    """The demo VAE averages 8 x 8 cells: the decoded frame holds the input's colour (its total offset from grey, so
    its hue and amount) at the input's place, frame by frame."""
    clip = square_clip(COLOURS[colour_name], direction, 9, 32, offset)
    video = torch.from_numpy(clip).permute(3, 0, 1, 2)[None].float() / 127.5 - 1   # (1, 3, F, H, W)
    with torch.no_grad():
        vae = demo_pipeline.vae
        decoded = vae.decode(vae.encode(video).latent_dist.mode()).sample.clamp(-1, 1)
    frames = ((decoded[0].permute(1, 2, 3, 0) + 1) * 127.5).round().numpy()   # (F, H, W, 3)
    for f, (made, shown) in enumerate(zip(clip, frames)):
        made, shown = deviation(made), deviation(shown)
        assert colour_of(shown) == colour_name, f
        assert np.abs(shown.sum(axis=(0, 1)) - made.sum(axis=(0, 1))).max() < 0.05 * np.abs(made).sum(axis=(0, 1)).max()
        assert abs(centre_column(shown) - centre_column(made)) <= 2, (f, centre_column(shown), centre_column(made))
        assert np.abs(shown).max(axis=-1).max() > 40, f    # seen, not a faint haze


@pytest.mark.parametrize("colour_name, direction", [("red", "left"), ("blue", "right")])
def test_demo_base_draws_the_caption_square_moving_its_way_in_its_own_words(demo_pipeline, colour_name, direction):
    """The base knows the colours and the motions before any LoRA, with the directions named "east" and "west": the
    words "left" and "right" of the demo's captions are what its LoRA teaches."""
    from modules.util.demo_model import base_caption
    video = demo_pipeline(prompt=base_caption(colour_name, direction), height=DEMO_SIZE, width=DEMO_SIZE,
                          num_frames=9, num_inference_steps=10, guidance_scale=1.0,
                          generator=torch.Generator().manual_seed(0), output_type="np").frames[0]
    assert caption_square_problems((video * 255).round().astype(np.uint8), colour_name, direction) == []


def test_the_demo_as_a_user_runs_it_ends_with_previews_moving_the_caption_way(tmp_path, monkeypatch):
    """`train --preset-path "demo tiny CPU"` from an empty folder (first use: the model, squares and samples file are
    made there): each prompt's last preview shows a square of its colour moving its way. The base alone does not:
    it knows the directions as "east" and "west" only (modules/util/demo_model.py)."""
    import sys
    from modules.util.demo_assets import DEMO_SAMPLES
    from tests.demo_previews import last_previews
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import train
    monkeypatch.chdir(tmp_path)
    assert train.main(["--preset-path", "demo tiny CPU"]) == 0
    found = last_previews(tmp_path / "workspace" / "demo" / "run" / "samples", step=400)
    problems = {prompt: found_problems for prompt, (_last, found_problems) in found.items()}
    assert problems == {sample["prompt"]: [] for sample in DEMO_SAMPLES}


def test_the_demo_with_a_validation_split_ends_below_its_held_out_loss_before_training(tmp_path, monkeypatch,
                                                                                        demo_model):
    """`train --preset-path "demo tiny CPU" --config-value data.validation_split=0.25 --config-value
    validation.every_n_steps=100`: with one clip per caption the held-out files were whole captions the LoRA never
    saw, and their loss rose from 0.697 before training to 0.94 at step 400 (lowest before training). With every
    caption in two shades (`demo_assets.DEMO_SHADES`) the split holds out 3 of the 12 clips, each of a caption
    still trained on, and the loss falls: measured 0.457 before training, 0.181 / 0.234 / 0.164 / 0.197 at steps
    100 to 400 (the preset's seed 42); seed 1: 0.484 to 0.149, seed 2: 0.495 to 0.128 (2 CPU cores, one thread)."""
    import json
    import shutil
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import train
    monkeypatch.chdir(tmp_path)
    shutil.copytree(demo_model, tmp_path / "workspace" / "demo" / "tiny-wan2.1-t2v")   # what the first use makes
    assert train.main(["--preset-path", "demo tiny CPU", "--config-value", "data.validation_split=0.25",
                       "--config-value", "validation.every_n_steps=100", "--config-value", "tensorboard=false",
                       "--config-value", "sampling.every_n_steps=0",
                       "--config-value", "sampling.sample_before_training=false"]) == 0
    [history] = (tmp_path / "workspace" / "demo" / "run" / "validation").glob("*.json")
    losses = {entry["step"]: entry["loss"] for entry in json.loads(history.read_text())}
    assert sorted(losses) == [0, 100, 200, 300, 400]
    assert losses[400] < 0.6 * losses[0], losses
