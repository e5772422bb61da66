"""The built-in demo: a tiny Wan model that knows the squares (modules/util/demo_model.py) and a synthetic dataset of
coloured squares moving left or right, the colour and direction named in the caption. Created on first use under the
workspace."""
import logging
from pathlib import Path

from modules.util.demo_model import make_demo_model
from modules.util.demo_paths import DEMO_CONCEPT, DEMO_MODEL, DEMO_SAMPLES_FILE, same_path, uses_demo_data
from modules.util.demo_squares import (BACKGROUND, COLOURS, DEMO_SIZE, DIRECTIONS,  # noqa: F401 (re-exported)
                                       demo_clip, shade, square_clip)
from modules.util.video_frames import write_video

log = logging.getLogger(__name__)


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


# several clips per caption, the square's colour at these strengths (`shade`; 1 is what the base was trained on):
# a file data.validation_split holds out then leaves its caption in training, and is a clip of it the LoRA has not
# seen (with one clip per caption the held-out files were whole captions, and their loss rose as the LoRA learned)
DEMO_SHADES = (1.0, 0.85)


def make_demo_t2v_dataset(output: str | Path, fps: int = 16) -> Path:
    """The demo's own squares at the demo's size (`demo_clip`): every caption once per shade of its colour."""
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    for colour_name, colour in COLOURS.items():
        for direction in DIRECTIONS:
            for index, strength in enumerate(DEMO_SHADES):
                stem = f"{colour_name}_{direction}_{index}"
                write_video(output / f"{stem}.mp4", demo_clip(shade(colour, strength), direction), fps)
                (output / f"{stem}.txt").write_text(f"a {colour_name} square moving {direction}\n")
    return output


# the demo's preview prompts: two of the training captions, at the training size, so the previews show the
# squares take the caption's direction as the LoRA learns. Guidance 1 (none): the demo trains without caption
# dropout, so the model has no unconditional prediction to guide against.
DEMO_SAMPLES = [{"prompt": "a red square moving left", "width": DEMO_SIZE, "height": DEMO_SIZE, "frames": 9,
                 "seed": 1,
                 "guidance": 1.0},
                {"prompt": "a blue square moving right", "width": DEMO_SIZE, "height": DEMO_SIZE, "frames": 9,
                 "seed": 2,
                 "guidance": 1.0}]


def ensure_demo_assets(config) -> list[str]:
    """Creates what is missing of the demo at the demo's own paths (modules/util/demo_paths.py), and only when the
    config trains on the demo's dataset; returns notes for the problems it leaves to the config check."""
    if not uses_demo_data(config):
        return ["demo_assets: the demo model, squares and samples are created only for the demo's own dataset "
                f"({DEMO_CONCEPT['path']}); this config trains on other data, so nothing was created"]
    base = Path(config.model.base_model_name)
    if same_path(base, DEMO_MODEL) and not (base / "model_index.json").is_file():
        log.warning("creating the tiny demo model at %s: its VAE is set to the squares and its base, "
                    "pre-trained on them, is loaded (a few seconds, once)", base)
        make_demo_model(base, seed=0)
    folder = Path(config.data.concepts[0].path)
    if not folder.is_dir() or not any(folder.iterdir()):
        log.warning("creating the demo dataset at %s", folder)
        make_demo_t2v_dataset(folder)
    samples_file = Path(config.sampling.samples_file) if config.sampling.samples_file else None
    if samples_file is not None and same_path(samples_file, DEMO_SAMPLES_FILE) and not samples_file.is_file():
        from modules.util.config.SampleConfig import SampleConfig
        from modules.util.sample_definitions import save_samples_json
        log.warning("creating the demo samples file at %s", samples_file)
        samples_file.parent.mkdir(parents=True, exist_ok=True)
        save_samples_json([SampleConfig(**sample) for sample in DEMO_SAMPLES], samples_file)
    return []
