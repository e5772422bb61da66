"""The demo run's last preview of each caption and what the square check finds in it (tests of the demo)."""
from pathlib import Path

import numpy as np

from modules.modelSampler.TrainingSampler import preview_step
from modules.util.demo_assets import DEMO_SAMPLES
from modules.util.square_check import caption_square_problems
from modules.util.video_io import read_media


def last_previews(samples_dir: Path, step: int) -> dict[str, tuple[Path, list[str]]]:
    """{caption: (its last preview, the square check's problems)}; every last preview must be at `step`."""
    found = {}
    for index, sample in enumerate(DEMO_SAMPLES):
        _, colour_name, _, _, direction = sample["prompt"].split()
        last = max(Path(samples_dir).glob(f"*/{index}-*/*.mp4"), key=preview_step)
        assert preview_step(last) == step, last
        found[sample["prompt"]] = (last, caption_square_problems(np.asarray(read_media(last)), colour_name, direction))
    return found
