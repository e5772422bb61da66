"""The synthetic E2V set in the layout of the user's notes (seed 001): `NNN.mp4`, `NNN.txt`, `NNN_person.png`,
`NNN_object.png`, `NNN_background.png`. The person reference is a coloured square and the clip shows a square of
that colour moving; the caption names only the direction, so the colour can only come from the reference. Object
and background are optional and left out of some samples."""
import json
from pathlib import Path

import numpy as np
from PIL import Image

from modules.util.demo_assets import BACKGROUND, COLOURS, DIRECTIONS, square_clip
from modules.util.video_frames import write_video

OBJECT_COLOUR = (230, 200, 40)


def reference_square(colour: tuple[int, int, int], size: int) -> np.ndarray:
    image = np.full((size, size, 3), BACKGROUND, np.uint8)
    quarter = size // 4
    image[quarter:size - quarter, quarter:size - quarter] = colour
    return image


def make_e2v_dataset(output: str | Path, clips_per_class: int = 4, frames: int = 17, size: int = 32,
                     fps: int = 16) -> Path:
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    number = 0
    for colour_name, colour in COLOURS.items():
        for direction in DIRECTIONS:
            for i in range(clips_per_class):
                stem = f"{number:03d}"
                write_video(output / f"{stem}.mp4", square_clip(colour, direction, frames, size, offset=i), fps)
                (output / f"{stem}.txt").write_text(f"The video shows a square moving {direction}\n")
                Image.fromarray(reference_square(colour, size)).save(output / f"{stem}_person.png")
                if number % 3 != 1:   # every third sample lacks the optional object
                    object_image = np.full((size, size, 3), BACKGROUND, np.uint8)
                    object_image[: size // 3, : size // 3] = OBJECT_COLOUR
                    Image.fromarray(object_image).save(output / f"{stem}_object.png")
                if number % 4 != 2:   # every fourth lacks the optional background
                    Image.fromarray(np.full((size, size, 3), BACKGROUND, np.uint8)).save(
                        output / f"{stem}_background.png")
                number += 1
    # the matching dataset config, in the nested form of the user's notes
    (output / "e2v_config.json").write_text(json.dumps(demo_e2v_config(output.resolve(), size), indent=2))
    return output


def demo_e2v_config(data_root: str | Path, size: int = 32) -> dict:
    """The seed 001 configuration, with the aligned repeats (1, 4, 4) and the demo's resolution."""
    def element(name, suffixes, required, position, preprocess):
        return {"name": name, "suffixes": suffixes, "required": required,
                "vae": {"repeat": 1 if position == 0 else 4, "position": position},
                "clip": {"preprocess": preprocess}}
    return {"datasets": [{
        "data_root": str(data_root), "dataset_type": "e2v", "target_resolution": [size, size],
        "auto_frame_buckets": True, "reshape_mode": "bicubic", "remove_common_llm_caption_prefixes": True,
        "elements": [element("main_subject", ["_dog.png", "_person.png", "_mask.png"], True, 0, "center_crop"),
                     element("secondary", ["_object.png", "_toy.png"], False, 1, "pad_white"),
                     element("environment", ["_background.png", "_scene.png"], False, 2, "letterbox")],
        "processors": {"vae": {"resolution": [size, size], "combine": "before", "default_preprocess": "resize",
                               "frame_conditioning": "full", "frame_index": 0, "concatenate_mask": True},
                       "clip": {"resolution": [size, size], "default_preprocess": "center_crop"}}}]}
