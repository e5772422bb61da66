"""The synthetic VACE set (make_demo_dataset --kind vace): the demo's moving squares, each clip with its control (the
square's white outline on black, as an edge annotator would draw it, frame by frame as lossless PNGs in
`<stem>_control/`) and one reference image (`<stem>_ref.png`: the square's colour on white, the "subject")."""
from itertools import product
from pathlib import Path

import numpy as np
from PIL import Image

from modules.util.demo_assets import BACKGROUND, COLOURS, DIRECTIONS, make_t2v_dataset, square_clip


def outline(clip: np.ndarray) -> np.ndarray:
    """The square's one-pixel border (its pixels with a 4-neighbour outside it or outside the frame) in white on
    black: (F, H, W, 3) uint8."""
    inside = np.any(clip != np.array(BACKGROUND, np.uint8), axis=-1)
    padded = np.pad(inside, ((0, 0), (1, 1), (1, 1)))
    interior = padded[:, :-2, 1:-1] & padded[:, 2:, 1:-1] & padded[:, 1:-1, :-2] & padded[:, 1:-1, 2:]
    edge = inside & ~interior
    return np.repeat(np.where(edge, 255, 0).astype(np.uint8)[..., None], 3, axis=-1)


def make_vace_dataset(output: str | Path, clips_per_class: int = 4, frames: int = 9, size: int = 32,
                      fps: int = 16) -> Path:
    """The t2v demo set (make_t2v_dataset) plus each clip's control frames and reference image."""
    output = make_t2v_dataset(output, clips_per_class, frames, size, fps)
    for (colour_name, colour), direction, i in product(COLOURS.items(), DIRECTIONS, range(clips_per_class)):
        stem = f"{colour_name}_{direction}_{i:02d}"
        (output / f"{stem}_control").mkdir(exist_ok=True)
        for index, frame in enumerate(outline(square_clip(colour, direction, frames, size, offset=i))):
            Image.fromarray(frame).save(output / f"{stem}_control" / f"{index:03d}.png")
        reference = np.full((size, size, 3), 255, np.uint8)
        reference[size // 4:3 * size // 4, size // 4:3 * size // 4] = colour
        Image.fromarray(reference).save(output / f"{stem}_ref.png")
    return output
