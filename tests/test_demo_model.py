"""The built-in demo shows something a newcomer can see: its clips move one way only."""
import numpy as np

from modules.util.demo_assets import COLOURS
from modules.util.video_io import read_media


def square_columns(frame: np.ndarray, colour: tuple[int, int, int]) -> np.ndarray:
    """The columns where the frame's pixels are near `colour` (H.264 blurs the edges a little)."""
    close = np.abs(frame.astype(int) - np.array(colour)).max(axis=-1) < 40
    return np.nonzero(close.any(axis=0))[0]


def test_demo_clips_move_only_the_way_their_caption_says(squares_dataset):
    """blue_left_01.mp4 went 20-31, ..., 2-11 and then jumped back to 22-31 in its last frame."""
    for path in sorted(squares_dataset.glob("*.mp4")):
        colour_name, direction, _ = path.stem.split("_")
        frames = read_media(path)
        centres = [square_columns(frame, COLOURS[colour_name]).mean() for frame in frames]
        steps = np.diff(centres) * (1 if direction == "right" else -1)
        assert len(frames) == 9 and (steps > 0).all(), (path.name, centres)
        assert abs(centres[-1] - centres[0]) > 16, (path.name, centres)   # it crosses the frame
