"""musubi-tuner's dataset config (TOML with `[general]` and `[[datasets]]`) as this trainer's concepts and data
settings. The keys and their meaning follow musubi-tuner's docs/dataset_config.md; docs/data.md here maps them.

Each `[[datasets]]` table becomes one concept. musubi-tuner makes one item per `target_frames` count a video holds
(and per window of `slide`, `chunk`, `uniform`): the concept's `target_frames` and extraction mode keep that.
Settings that are global here (resolution, bucketing, batch size) must agree across the datasets.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from modules.util.config.ConfigError import ConfigError
from modules.util.config.dataset_toml_checks import check_exists, check_keys, round_frames
from modules.util.text_encoding import read_text_file

log = logging.getLogger(__name__)

SHARED_KEYS = {"resolution", "caption_extension", "batch_size", "num_repeats", "enable_bucket", "bucket_no_upscale"}
SOURCE_KEYS = ("video_directory", "video_jsonl_file", "image_directory", "image_jsonl_file")
# mask_directory / require_mask: blissful-tuner's masked loss (a musubi-tuner fork; its docs' "Weighted Mask Loss
# Training Guide"): masks named as the media in a folder, and items without one refused
DATASET_KEYS = SHARED_KEYS | set(SOURCE_KEYS) | {"cache_directory", "target_frames", "frame_extraction",
                                                 "frame_stride", "frame_sample", "max_frames", "source_fps",
                                                 "mask_directory", "require_mask", "control_directory"}
REFUSED = {
    "multiple_target": "Qwen-Image-Layered targets are not trained here",
    "no_resize_control": "control images are not trained here",
    "control_resolution": "control images are not trained here",
    "fp_latent_window_size": "a FramePack setting",
    "fp_1f_clean_indices": "a FramePack setting",
    "fp_1f_target_index": "a FramePack setting",
    "fp_1f_no_post": "a FramePack setting",
    "debug_dataset": "a musubi-tuner command-line option",
    "alpha_mask": "masks from the images' alpha channel are not read; give the masks as files (mask_directory)",
}
# what each musubi-tuner frame_extraction is called here (its "uniform" is a different mode from ours)
EXTRACTION = {"head": "head", "chunk": "chunk", "slide": "slide", "uniform": "spaced", "full": "full"}
# a line's mask_path is read as its loss mask (docs/masks.md), its control_path as its control video (VACE,
# docs/vace.md); several control images per line (control_path_N) are edit-model data
JSONL_REFUSED_KEYS = ("control_path_0", "image_path_0")


def _size(value, where: str, problems: list[str]) -> tuple[int, int] | None:
    """musubi-tuner's resolution: [width, height], or one number for a square."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value, value]
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value)):
        problems.append(f"{where}: {value!r} is not [width, height] (two positive whole numbers) or one number")
        return None
    return value[0], value[1]


def musubi_buckets_aspects(width: int, height: int, step: int = 16) -> list[float]:
    """The aspect ratios of musubi-tuner's buckets for this area (its enable_bucket): widths from half the square
    side to the side in steps of `step`, each with the height that keeps the area, both orientations."""
    area = width * height
    side = int(area ** 0.5)
    low = (side // 2) - (side // 2) % step
    ratios = set()
    for w in range(low, side + step, step):
        h = (area // w) - (area // w) % step
        if h > 0:
            ratios |= {w / h, h / w}
    return sorted(ratios, reverse=True)


def _refused_jsonl_keys(manifest: str) -> list[str]:
    found = set()
    try:
        lines = read_text_file(manifest).splitlines()
    except OSError:
        return []  # the scan reports unreadable manifests with the file named
    for line in lines:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            found |= {k for k in entry if k in JSONL_REFUSED_KEYS or k.startswith(("control_path_", "image_path_"))}
    return sorted(found)


def _concept(dataset: dict, general: dict, where: str, source_file: str,
             problems: list[str]) -> dict | None:
    def value(key, default=None):
        return dataset.get(key, general.get(key, default))

    sources = [k for k in SOURCE_KEYS if k in dataset]
    if len(sources) != 1:
        problems.append(f"{where}: needs exactly one of {', '.join(SOURCE_KEYS)}; got {sources or 'none'}")
        return None
    source = sources[0]
    is_jsonl = source.endswith("_jsonl_file")
    check_exists(dataset[source], where + source, problems, want_file=is_jsonl)
    if is_jsonl:
        for key in _refused_jsonl_keys(dataset[source]):
            problems.append(f"{where}{source}: its lines hold {key!r}: several control images and layered targets are "
                            f"not trained here; supported line keys: video_path or image_path, caption, mask_path, "
                            f"control_path (a control model's control video)")
    concept: dict = {"name": f"{Path(source_file).name}: {where}{source}", "path": dataset[source]}
    repeats = value("num_repeats", 1)
    if not isinstance(repeats, int) or repeats < 1:
        problems.append(f"{where}num_repeats: {repeats!r} is not a whole number >= 1")
    else:
        concept["repeats"] = repeats
    extension = value("caption_extension")
    if extension is not None and not is_jsonl:
        if not isinstance(extension, str) or not extension.startswith(".") or len(extension) < 2:
            problems.append(f"{where}caption_extension: {extension!r} is not a file extension such as '.txt'")
        else:
            concept["caption_extension"] = extension
    if "mask_directory" in dataset:
        check_exists(dataset["mask_directory"], where + "mask_directory", problems)
        concept["mask_path"] = dataset["mask_directory"]
    if "control_directory" in dataset:   # control videos named as the videos (VACE: docs/vace.md)
        check_exists(dataset["control_directory"], where + "control_directory", problems)
        concept["control_path"] = dataset["control_directory"]
    if "require_mask" in dataset:
        if not isinstance(dataset["require_mask"], bool):
            problems.append(f"{where}require_mask: {dataset['require_mask']!r} is not true or false")
        else:
            concept["mask_required"] = dataset["require_mask"]
    if "cache_directory" in dataset:
        log.warning("%scache_directory is not used: this trainer keeps one cache (cache_dir), keyed by content and "
                    "settings; musubi-tuner's cache files are not read", where)
    if source.startswith("image"):
        video_only = sorted(k for k in ("target_frames", "frame_extraction", "frame_stride", "frame_sample",
                                        "max_frames", "source_fps") if k in dataset)
        if video_only:
            problems.append(f"{where}{', '.join(video_only)}: video settings in an image dataset")
        concept.update({"target_frames": [1], "fps": "source"})
        return concept
    mode = dataset.get("frame_extraction", "head")
    if mode not in EXTRACTION:
        problems.append(f"{where}frame_extraction: {mode!r} is not one of {', '.join(EXTRACTION)}")
        return None
    targets = round_frames(dataset.get("target_frames", [1]), where + "target_frames", problems)
    stride, sample, max_frames = (dataset.get(k, d) for k, d in
                                  (("frame_stride", 1), ("frame_sample", 1), ("max_frames", 129)))
    for key, number in (("frame_stride", stride), ("frame_sample", sample), ("max_frames", max_frames)):
        if not isinstance(number, int) or number < 1:
            problems.append(f"{where}{key}: {number!r} is not a whole number >= 1")
    source_fps = dataset.get("source_fps")
    if source_fps is not None and not (isinstance(source_fps, (int, float)) and source_fps > 0):
        problems.append(f"{where}source_fps: {source_fps!r} is not a positive frame rate")
    if mode == "uniform" and sample == 1:
        mode = "head"  # musubi-tuner does the same, with a warning
    # musubi-tuner uses every frame as stored unless source_fps asks for a conversion to the model's rate; here the
    # conversion reads each file's own frame times (source_fps is not needed for that)
    concept.update({"extraction": EXTRACTION[mode], "fps": "model" if source_fps is not None else "source"})
    if source_fps is not None:
        concept["frames_fps"] = source_fps  # a folder of images (a video_path, a sub-folder) is a clip at this rate
    if not is_jsonl:
        concept["frame_folders"] = True  # a video_directory's sub-folders of images are clips, as a video_path's
    if mode == "full":
        concept["max_frames"] = max_frames
    else:
        concept.update({"target_frames": targets, "max_frames": max(targets) if targets else 1})
    if mode == "slide":
        concept["slide_stride"] = stride
    if mode == "uniform":
        concept["window_count"] = sample
    return concept


def musubi_settings(table: dict, source: str) -> dict:
    problems: list[str] = []
    check_keys(table, "", {"general", "datasets"}, {}, problems, "the file")
    general = table.get("general", {})
    datasets = table.get("datasets")
    if not isinstance(general, dict):
        problems.append("general: must be a table ([general])")
        general = {}
    check_keys(general, "general.", SHARED_KEYS, REFUSED, problems, "[general]")
    if not isinstance(datasets, list) or not datasets or not all(isinstance(d, dict) for d in datasets):
        raise ConfigError(problems + ["datasets: needs at least one [[datasets]] table"], source)
    concepts = []
    shared: dict[str, tuple[str, object]] = {}  # key -> (where it was first set, value)
    for index, dataset in enumerate(datasets):
        where = f"datasets.{index}."
        check_keys(dataset, where, DATASET_KEYS, REFUSED, problems, "[[datasets]]")
        concept = _concept(dataset, general, where, source, problems)
        if concept is not None:
            concepts.append(concept)
        for key in ("resolution", "enable_bucket", "bucket_no_upscale", "batch_size"):
            if key in dataset or key in general:
                value = dataset.get(key, general.get(key))
                first = shared.setdefault(key, (where if key in dataset else "general.", value))
                if first[1] != value:
                    problems.append(f"{where}{key}: {value!r} differs from {first[0]}{key} ({first[1]!r}); one "
                                    f"{key} applies to every dataset here")
    data: dict = {"concepts": concepts}
    settings: dict = {"data": data}
    if "resolution" in shared:
        size = _size(shared["resolution"][1], shared["resolution"][0] + "resolution", problems)
        if size is not None:
            width, height = size
            data["resolution"] = f"{width}x{height}"  # exactly W x H for its aspect, the same area for the others
            bucketed = shared.get("enable_bucket", ("", False))[1] is True
            data["aspect_ratios"] = musubi_buckets_aspects(width, height) if bucketed else [width / height]
    if "bucket_no_upscale" in shared:
        data["no_upscale"] = shared["bucket_no_upscale"][1] is True
    if "batch_size" in shared:
        batch = shared["batch_size"][1]
        if not isinstance(batch, int) or batch < 1:
            problems.append(f"{shared['batch_size'][0]}batch_size: {batch!r} is not a whole number >= 1")
        else:
            settings["batch_size"] = batch
    counts = sorted({t for c in concepts for t in c.get("target_frames", [])})
    if counts:
        data["frame_buckets"] = counts
    if problems:
        raise ConfigError(problems, source)
    return settings
