"""The synthetic VACE set (make_demo_dataset --kind vace): the demo's moving squares, each clip with its control (the
square's white outline on black, as an edge annotator would draw it, frame by frame as lossless PNGs in
`<stem>_control/`) and one reference image (`<stem>_ref.png`: the square's colour on white, the "subject"). The
captions name the colour only ("a red square"): where the square is and which way it moves is the control's to say,
so a model that follows the control can be told from one that reads the caption.

`make_demo_vace_model` is the tiny VACE model with the demo's VAE (modules/util/demo_vae.py). A random tiny VAE
hardly encodes where anything is (measured on the 32 x 32 squares: the latents of a square moving left and of the
same square moving right differ by a mean square of 0.06 where two colours differ by 0.30, and the outline controls'
contexts by 0.02 against their variance of 0.8), so on it neither the control a model sees nor the target it must
reach says where the square is; the demo's VAE encodes each 8 x 8 cell as its colour (0.74 left against right)."""
from itertools import product
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from modules.util.atomic import atomic_dir
from modules.util.demo_assets import BACKGROUND, COLOURS, DIRECTIONS, make_t2v_dataset, square_clip
from modules.util.demo_model import set_latent_stats
from modules.util.demo_vae import set_cell_average_weights
from modules.util.portable_folder import make_portable
from modules.util.tiny_models import make_tiny_pipeline, replaceable_folder


STATS_FRAMES, STATS_SIZE, STATS_OFFSETS = 9, 32, range(4)


def colour_caption(colour_name: str) -> str:
    """The VACE set's caption: the colour only, so that where the square goes can come from the control alone."""
    return f"a {colour_name} square"


def vace_square_videos() -> torch.Tensor:
    """Every colour, direction and start offset of the VACE set's squares, (N, 3, F, H, W) in [-1, 1]: the clips
    its VAE's latent statistics are measured on."""
    clips = [torch.from_numpy(square_clip(colour, direction, STATS_FRAMES, STATS_SIZE, offset))
             for colour in COLOURS.values() for direction in DIRECTIONS for offset in STATS_OFFSETS]
    # each (F, H, W, 3) uint8 -> (3, F, H, W) in [-1, 1]
    return torch.stack([clip.permute(3, 0, 1, 2).float() / 127.5 - 1 for clip in clips])


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
    """The t2v demo set (make_t2v_dataset) with colour-only captions, plus each clip's control frames and reference
    image."""
    output = make_t2v_dataset(output, clips_per_class, frames, size, fps)
    for (colour_name, colour), direction, i in product(COLOURS.items(), DIRECTIONS, range(clips_per_class)):
        stem = f"{colour_name}_{direction}_{i:02d}"
        (output / f"{stem}.txt").write_text(colour_caption(colour_name) + "\n")
        (output / f"{stem}_control").mkdir(exist_ok=True)
        for index, frame in enumerate(outline(square_clip(colour, direction, frames, size, offset=i))):
            Image.fromarray(frame).save(output / f"{stem}_control" / f"{index:03d}.png")
        reference = np.full((size, size, 3), 255, np.uint8)
        reference[size // 4:3 * size // 4, size // 4:3 * size // 4] = colour
        Image.fromarray(reference).save(output / f"{stem}_ref.png")
    return output


def make_demo_vace_model(output_dir: str | Path, seed: int = 0) -> Path:
    """Writes the tiny Wan 2.1 VACE model (`make_tiny_model --variant wan2.1-vace`) with the demo's VAE, which encodes
    each 8 x 8 cell as its colour, and latent statistics measured on the squares; the transformer stays random."""
    output_dir = replaceable_folder(output_dir)
    pipeline = make_tiny_pipeline("wan2.1-vace", seed)
    set_cell_average_weights(pipeline.vae)
    set_latent_stats(pipeline.vae, vace_square_videos())
    with atomic_dir(output_dir) as tmp:
        pipeline.save_pretrained(tmp, safe_serialization=True)
        make_portable(tmp)
    return output_dir
