"""What `data.resolution` means (docs/configuration.md has the table of the buckets each value yields).

- a named resolution, `"480p"` or `"720p"`: the size the Wan releases and their peers mean by the name, 832x480 and
  1280x720 (width x height), used as `"WxH"` below;
- `"WxH"` (e.g. `"832x480"`): a 16:9-ish clip trains at exactly W x H (an aspect ratio of `data.aspect_ratios` within
  5 % of W:H gives exactly W x H, one within 5 % of H:W exactly H x W; W x H is added when no ratio is that close),
  the other aspect ratios keep the area W * H. Sides are rounded down to the model's spatial unit (16; 32 for
  TI2V-5B, so "720p" is 1280x704 there, as Wan 2.2 names it);
- an integer N (what configs before named resolutions wrote, unchanged): every aspect ratio at the area N x N, sides
  rounded half up to the unit; `480` gives 640x368 for 16:9, not 832x480.
"""
from __future__ import annotations

import math
import re

NAMED_RESOLUTIONS = {"480p": (832, 480), "720p": (1280, 720)}
EXACT_RATIO_TOLERANCE = math.log(1.05)
_SIZE = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


def parse_resolution(value: int | str) -> tuple[int, int] | None:
    """(width, height) for a named or "WxH" resolution; None for an integer (area) resolution. Raises ValueError
    for anything else."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a resolution")
    if isinstance(value, int):
        if value < 16:
            raise ValueError(f"an integer resolution is the side of a square of the buckets' area, at least 16; "
                             f"got {value}")
        return None
    text = str(value).strip().lower()
    if text in NAMED_RESOLUTIONS:
        return NAMED_RESOLUTIONS[text]
    if text.isdigit():
        return parse_resolution(int(text))
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{value!r} is not a resolution: use {', '.join(map(repr, NAMED_RESOLUTIONS))}, a width x "
                         f"height like '832x480', or an integer (the side of a square of the buckets' area)")
    width, height = int(match.group(1)), int(match.group(2))
    if width < 16 or height < 16:
        raise ValueError(f"{value!r}: each side must be at least 16")
    return width, height


def _area_bucket(area: float, ratio: float, unit: int) -> tuple[int, int]:
    # sides rounded half up (the epsilon keeps exact halves from float noise)
    height = max(unit, math.floor(math.sqrt(area / ratio) / unit + 0.5 + 1e-9) * unit)
    width = max(unit, math.floor(math.sqrt(area * ratio) / unit + 0.5 + 1e-9) * unit)
    return height, width


def make_buckets(resolution: int | str, aspect_ratios: list[float], unit: int) -> list[tuple[int, int]]:
    """The (height, width) buckets of a resolution, in `aspect_ratios` order, duplicates removed."""
    if not aspect_ratios or any(r <= 0 for r in aspect_ratios):
        raise ValueError(f"aspect ratios must be positive numbers; got {aspect_ratios}")
    size = parse_resolution(resolution)
    buckets: list[tuple[int, int]] = []

    def add(bucket: tuple[int, int]) -> None:
        if bucket not in buckets:
            buckets.append(bucket)

    if size is None:
        for ratio in aspect_ratios:
            add(_area_bucket(resolution * resolution, ratio, unit))
        return buckets
    width, height = size
    landscape = (max(unit, height // unit * unit), max(unit, width // unit * unit))  # (h, w)
    portrait = landscape[::-1]
    near = [abs(math.log(r * height / width)) <= EXACT_RATIO_TOLERANCE for r in aspect_ratios]
    near_transposed = [abs(math.log(r * width / height)) <= EXACT_RATIO_TOLERANCE for r in aspect_ratios]
    if not any(near):
        add(landscape)
    for ratio, is_near, is_near_transposed in zip(aspect_ratios, near, near_transposed):
        if is_near:
            add(landscape)
        elif is_near_transposed:
            add(portrait)
        else:
            add(_area_bucket(width * height, ratio, unit))
    return buckets
