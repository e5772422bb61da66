"""The built-in demo: a tiny random Wan model and a synthetic dataset of coloured squares moving left or right,
the colour and direction named in the caption. Created on first use under the workspace."""
import logging
from pathlib import Path

import numpy as np

from modules.util.demo_paths import DEMO_CONCEPT, DEMO_MODEL, DEMO_SAMPLES_FILE, same_path, uses_demo_data
from modules.util.video_frames import write_video

log = logging.getLogger(__name__)

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 230)}
DIRECTIONS = ("left", "right")
BACKGROUND = 96


def square_clip(colour: tuple[int, int, int], direction: str, frames: int, size: int, offset: int,
                square: int | None = None) -> np.ndarray:
    """(frames, size, size, 3) uint8: a square crossing the frame horizontally, `offset` pixels in from the edge it
    starts at, reaching the other edge in the last frame. The position only ever moves the named way (it never
    wraps back to the first edge)."""
    square = square or max(4, size // 3)
    clip = np.full((frames, size, size, 3), BACKGROUND, dtype=np.uint8)
    top = (size - square) // 2
    travel = size - square
    start = min(offset, travel)
    for f in range(frames):
        x = start + round(f * (travel - start) / max(1, frames - 1))
        if direction == "left":
            x = travel - x
        clip[f, top:top + square, x:x + square] = colour
    return clip


def make_t2v_dataset(output: str | Path, clips_per_class: int = 4, frames: int = 9, size: int = 32,
                     fps: int = 16) -> Path:
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    for colour_name, colour in COLOURS.items():
        for direction in DIRECTIONS:
            for i in range(clips_per_class):
                stem = f"{colour_name}_{direction}_{i:02d}"
                write_video(output / f"{stem}.mp4", square_clip(colour, direction, frames, size, offset=i), fps)
                (output / f"{stem}.txt").write_text(f"a {colour_name} square moving {direction}\n")
    return output


# the demo's preview prompts: two of the training captions, at the training size, so the previews show the
# squares appear as the LoRA learns
DEMO_SAMPLES = [{"prompt": "a red square moving left", "width": 32, "height": 32, "frames": 9, "seed": 1},
                {"prompt": "a blue square moving right", "width": 32, "height": 32, "frames": 9, "seed": 2}]


def ensure_demo_assets(config) -> list[str]:
    """Creates what is missing of the demo at the demo's own paths (modules/util/demo_paths.py), and only when the
    config trains on the demo's dataset; returns notes for the problems it leaves to the config check."""
    from modules.util.tiny_models import make_tiny_model
    if not uses_demo_data(config):
        return ["demo_assets: the demo model, squares and samples are created only for the demo's own dataset "
                f"({DEMO_CONCEPT['path']}); this config trains on other data, so nothing was created"]
    base = Path(config.model.base_model_name)
    if same_path(base, DEMO_MODEL) and not (base / "model_index.json").is_file():
        log.warning("creating the tiny demo model at %s", base)
        make_tiny_model("wan2.1-t2v", base, seed=0)
    folder = Path(config.data.concepts[0].path)
    if not folder.is_dir() or not any(folder.iterdir()):
        log.warning("creating the demo dataset at %s", folder)
        make_t2v_dataset(folder)
    samples_file = Path(config.sampling.samples_file) if config.sampling.samples_file else None
    if samples_file is not None and same_path(samples_file, DEMO_SAMPLES_FILE) and not samples_file.is_file():
        from modules.util.config.SampleConfig import SampleConfig
        from modules.util.sample_definitions import save_samples_json
        log.warning("creating the demo samples file at %s", samples_file)
        samples_file.parent.mkdir(parents=True, exist_ok=True)
        save_samples_json([SampleConfig(**sample) for sample in DEMO_SAMPLES], samples_file)
    return []
