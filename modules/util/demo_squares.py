"""The demo's squares: a coloured square crossing a grey frame left or right (the dataset, the demo model's
training clips and many tests draw them)."""
import numpy as np

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
