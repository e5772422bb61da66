"""The demo's squares: a coloured square crossing a grey frame left or right (the dataset, the demo model's
training clips and many tests draw them)."""
import numpy as np

COLOURS = {"red": (220, 40, 40), "green": (40, 200, 60), "blue": (40, 80, 230)}
DIRECTIONS = ("left", "right")
BACKGROUND = 96
# The demo's own clips: 16 x 16 frames, an 8 x 8 square in the top row of the VAE's 8 x 8 cells, crossing the frame
# by one cell. One latent frame is then one transformer token (patch 1 x 2 x 2 of the 2 x 2 latent), so where the
# square is lies in the token's channels: Wan's relative RoPE cannot tell a token where in the frame it is, which
# is what kept the 32 x 32 demo (2 x 2 tokens a frame) from placing the square (modules/util/demo_model.py).
DEMO_SIZE = 16
DEMO_SQUARE = 8
# cell-aligned: a square straddling two cell rows decodes at half strength, between two columns too at a quarter
DEMO_TOP = 0


def square_clip(colour: tuple[int, int, int], direction: str, frames: int, size: int, offset: int,
                square: int | None = None, top: int | None = None) -> np.ndarray:
    """(frames, size, size, 3) uint8: a square crossing the frame horizontally, `offset` pixels in from the edge it
    starts at, reaching the other edge in the last frame. The position only ever moves the named way (it never
    wraps back to the first edge). `top`: the square's first row (centred when None)."""
    square = square or max(4, size // 3)
    clip = np.full((frames, size, size, 3), BACKGROUND, dtype=np.uint8)
    top = (size - square) // 2 if top is None else top
    travel = size - square
    start = min(offset, travel)
    for f in range(frames):
        x = start + round(f * (travel - start) / max(1, frames - 1))
        if direction == "left":
            x = travel - x
        clip[f, top:top + square, x:x + square] = colour
    return clip


def shade(colour: tuple[int, int, int], strength: float) -> tuple[int, int, int]:
    """The colour with its offset from the grey background scaled by `strength` (1: the colour itself)."""
    return tuple(round(BACKGROUND + strength * (c - BACKGROUND)) for c in colour)


def demo_clip(colour: tuple[int, int, int], direction: str, frames: int = 9) -> np.ndarray:
    """One of the demo's own clips (DEMO_SIZE frames, the square from one edge to the other)."""
    return square_clip(colour, direction, frames, DEMO_SIZE, 0, DEMO_SQUARE, DEMO_TOP)
