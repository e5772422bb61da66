"""diffusion-pipe's dataset config (TOML with top-level settings and `[[directory]]` tables) as this trainer's
concepts and data settings. The keys and their meaning follow diffusion-pipe's examples/dataset.toml and
utils/dataset.py; docs/data.md here maps them.

Each `[[directory]]` becomes one concept. diffusion-pipe resamples videos to the model's frame rate and puts each
in the longest frame bucket it holds, as `fps: model` with the default extraction does here. The top level's
resolution, aspect and frame buckets are the data section's; a directory that sets its own (as diffusion-pipe's
examples/dataset.toml shows) gets them as its concept's `resolution` / `aspect_ratios` / `frame_buckets`.
`mask_path` / `default_mask_file` become the concept's loss masks (docs/masks.md).
"""
from __future__ import annotations

import math
from pathlib import Path

from modules.util.config.ConfigError import ConfigError
from modules.util.config.dataset_toml_checks import check_exists, check_keys, round_frames

BUCKET_KEYS = {"resolutions", "enable_ar_bucket", "min_ar", "max_ar", "num_ar_buckets", "ar_buckets", "frame_buckets"}
TOP_KEYS = BUCKET_KEYS | {"num_repeats", "skip_empty_caption", "shuffle_metadata", "directory"}
MASK_KEYS = {"mask_path", "default_mask_file"}
DIRECTORY_KEYS = BUCKET_KEYS | MASK_KEYS | {"path", "num_repeats", "skip_empty_caption", "shuffle_metadata",
                                            "control_path"}
REFUSED = {
    "size_buckets": "fixed (width, height, frames) buckets; use resolutions with ar_buckets and frame_buckets",
    "cache_shuffle_num": "caption tag shuffling is not supported",
    "cache_shuffle_delimiter": "caption tag shuffling is not supported",
    "shuffle_tags": "caption tag shuffling is not supported",
    "caption_prefix": "caption prefixes are not supported",
    "subsample_ratio": "subsampling is not supported; use a concept's balancing",
    "online_captions": "captions.json files are not read",
}


def _resolution(values, where: str, problems: list[str]) -> int | None:
    """One training area: a side, or [width, height] (diffusion-pipe uses only the area of a pair)."""
    if not isinstance(values, list) or len(values) != 1:
        problems.append(f"{where}: {values!r}: exactly one resolution is supported (diffusion-pipe's several "
                        f"resolutions train the dataset once per area)")
        return None
    value = values[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 16:
        return int(round(value))
    if isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return round(math.sqrt(value[0] * value[1]))
    problems.append(f"{where}: {value!r} is not a side (>= 16) or [width, height]")
    return None


def _aspects(settings: dict, where: str, problems: list[str]) -> list[float] | None:
    if settings.get("enable_ar_bucket", False) is not True:
        return [1.0]  # diffusion-pipe without aspect buckets trains square crops
    if "ar_buckets" in settings:
        ratios = []
        for value in settings["ar_buckets"] if isinstance(settings["ar_buckets"], list) else [None]:
            if isinstance(value, list) and len(value) == 2 and all(isinstance(v, (int, float)) and v > 0
                                                                   for v in value):
                ratios.append(value[0] / value[1])
            elif isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                ratios.append(float(value))
            else:
                problems.append(f"{where}ar_buckets: {value!r} is not a width/height ratio or [width, height]")
        return sorted(set(ratios), reverse=True) or None
    missing = [k for k in ("min_ar", "max_ar", "num_ar_buckets") if k not in settings]
    if missing:
        problems.append(f"{where}{', '.join(missing)}: required with enable_ar_bucket = true and no ar_buckets")
        return None
    low, high, count = settings["min_ar"], settings["max_ar"], settings["num_ar_buckets"]
    if not (isinstance(count, int) and count >= 1 and isinstance(low, (int, float)) and isinstance(high, (int, float))
            and 0 < low <= high):
        problems.append(f"{where}min_ar, max_ar, num_ar_buckets: {low!r}, {high!r}, {count!r} are not "
                        f"0 < min_ar <= max_ar and a whole count >= 1")
        return None
    # evenly spaced in log space, as diffusion-pipe's geomspace
    return sorted({low * (high / low) ** (i / (count - 1)) if count > 1 else float(low) for i in range(count)},
                  reverse=True)


def _buckets(settings: dict, where: str, problems: list[str]) -> dict:
    """The data settings that the bucket keys written in `settings` give (keys not written give nothing: the
    config's own data settings stay)."""
    data: dict = {}
    if "resolutions" in settings:
        resolution = _resolution(settings["resolutions"], where + "resolutions", problems)
        if resolution is not None:
            data["resolution"] = resolution
    if any(k in settings for k in BUCKET_KEYS - {"resolutions", "frame_buckets"}):
        aspects = _aspects(settings, where, problems)
        if aspects is not None:
            data["aspect_ratios"] = aspects
    if "frame_buckets" in settings:
        counts = round_frames(settings["frame_buckets"], where + "frame_buckets", problems)
        if counts:
            data["frame_buckets"] = sorted(set(counts) | {1})  # diffusion-pipe always adds the image bucket
    return data


def diffusion_pipe_settings(table: dict, source: str) -> dict:
    problems: list[str] = []
    check_keys(table, "", TOP_KEYS, REFUSED, problems, "the top level")
    directories = table.get("directory")
    if not isinstance(directories, list) or not directories or not all(isinstance(d, dict) for d in directories):
        raise ConfigError(problems + ["directory: needs at least one [[directory]] table"], source)
    if "resolutions" not in table and not all("resolutions" in d for d in directories):
        problems.append("resolutions: required (diffusion-pipe has no default), e.g. resolutions = [512]")
    data = _buckets(table, "", problems)
    # the top level's own buckets, never a directory's; diffusion-pipe's defaults where it sets none (utils/dataset.py:
    # square without enable_ar_bucket, frame_buckets [1])
    data.setdefault("aspect_ratios", [1.0])
    data.setdefault("frame_buckets", [1])
    concepts = []
    for index, directory in enumerate(directories):
        where = f"directory.{index}."
        check_keys(directory, where, DIRECTORY_KEYS, REFUSED, problems, "[[directory]]")
        if "path" not in directory:
            problems.append(f"{where}path: required")
            continue
        check_exists(directory["path"], where + "path", problems)
        own: dict = {}
        if any(k in directory for k in BUCKET_KEYS):
            inherited = {k: v for k, v in table.items() if k in BUCKET_KEYS}
            own = _buckets({**inherited, **directory}, where, problems)
            if "resolution" in own:  # required somewhere: a directory's stands in where the top level has none
                data.setdefault("resolution", own["resolution"])
        repeats = directory.get("num_repeats", table.get("num_repeats", 1))
        if not isinstance(repeats, (int, float)) or isinstance(repeats, bool) or repeats <= 0:
            problems.append(f"{where}num_repeats: {repeats!r} is not a positive number")
            repeats = 1
        required = directory.get("skip_empty_caption", table.get("skip_empty_caption", True))
        concept = {"name": f"{Path(source).name}: {where}path", "path": directory["path"], "repeats": repeats,
                   "caption_required": required is True, "fps": "model", "extraction": "head"}
        # this directory's buckets where they differ from the data section's (diffusion-pipe applies them to it)
        concept.update({key: value for key, value in own.items() if data.get(key) != value})
        # masked training: masks named as the media files in a folder, and one mask for the files without
        # (diffusion-pipe's examples/dataset.toml); docs/masks.md
        if "mask_path" in directory:
            check_exists(directory["mask_path"], where + "mask_path", problems)
            concept["mask_path"] = directory["mask_path"]
        if "control_path" in directory:   # controls named as the media files (VACE: docs/vace.md)
            check_exists(directory["control_path"], where + "control_path", problems)
            concept["control_path"] = directory["control_path"]
        if "default_mask_file" in directory:
            check_exists(directory["default_mask_file"], where + "default_mask_file", problems, want_file=True)
            concept["default_mask"] = directory["default_mask_file"]
        concepts.append(concept)
    if problems:
        raise ConfigError(problems, source)
    data["concepts"] = concepts
    return {"data": data}
