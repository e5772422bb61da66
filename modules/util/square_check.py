"""Whether a clip shows the square its caption names: the check the demo's tests, its previews' measurements and
scripts/make_demo_accelerator.py apply (`caption_square_problems`)."""
import numpy as np

from modules.util.demo_squares import BACKGROUND, COLOURS


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
