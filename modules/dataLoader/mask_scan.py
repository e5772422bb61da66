"""Finding each clip's loss mask before any model loads (docs/masks.md).

A mask is an image (one mask for every frame) or a video with the clip's frame count; white = learn, black =
ignore, grey a weight in between (the red channel is read, as diffusion-pipe does). It is found, in this order:
beside the clip as `<stem>_mask.<ext>`; in the concept's `mask_path` folder under the clip's stem (diffusion-pipe's
layout: `1.jpg` may have `1.png`); the concept's `default_mask`. Masks beside the clips are not training media."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from modules.util.video_io import MEDIA_EXTENSIONS, probe_media, read_frames

MASK_SUFFIX = "_mask"
# a PNG first: lossless, what mask tools write; then the other media extensions in a fixed order
_EXTENSION_ORDER = [".png"] + sorted(MEDIA_EXTENSIONS - {".png"})


def _by_stem(folder: Path, stem: str) -> Path | None:
    for extension in _EXTENSION_ORDER:
        for candidate in (folder / f"{stem}{extension}", folder / f"{stem}{extension.upper()}"):
            if candidate.is_file():
                return candidate
    return None


def is_beside_mask(path: Path, media: set[Path]) -> bool:
    """`path` is `<stem>_mask.<ext>` and a media file `<stem>.<any ext>` lies beside it (then it is that file's
    mask, not a clip of its own)."""
    if not path.stem.endswith(MASK_SUFFIX):
        return False
    stem = path.stem[:-len(MASK_SUFFIX)]
    return any(other.parent == path.parent and other.stem == stem and other != path for other in media)


def find_mask(media: Path, concept) -> Path | None:
    beside = _by_stem(media.parent, media.stem + MASK_SUFFIX)
    if beside is not None:
        return beside
    if concept.mask_path:
        found = _by_stem(Path(concept.mask_path), media.stem)
        if found is not None:
            return found
    if concept.default_mask:
        return Path(concept.default_mask)
    return None


def mask_is_black(path: str | Path) -> bool:
    """Every pixel of every frame is 0 in the red channel: the item would carry no loss at all."""
    info = probe_media(path)
    step = 16  # frames read at a time, so a long mask video is not held whole
    for start in range(0, info.frame_count, step):
        frames = read_frames(path, range(start, min(start + step, info.frame_count)), info)
        if np.any(frames[..., 0]):
            return False
    return True
