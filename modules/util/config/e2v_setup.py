"""Resolves a training config's E2V section into validated dataset configs with the command-line overrides
applied, and the data settings they imply (resolution, frame buckets)."""
import logging
import math
from pathlib import Path

from pydantic import ValidationError

from modules.util.config.ConfigError import ConfigError
from modules.util.config.validation_problems import format_validation_error
from modules.util.config.E2VConfig import (E2VDatasetConfig, load_e2v_dataset_configs, min_clip_frames,
                                           round_to_spatial_unit)
from modules.util.config.TrainConfig import TrainConfig

log = logging.getLogger(__name__)


def resolve_e2v_datasets(config: TrainConfig, spatial_unit: int = 16) -> list[E2VDatasetConfig]:
    """The validated datasets with e2v.* overrides applied and each resolution rounded to `spatial_unit` (one notice
    per rounded field). Raises ConfigError with every problem of every dataset at once."""
    e2v = config.e2v
    if e2v.dataset_config and e2v.datasets:
        raise ConfigError(["e2v: set either e2v.dataset_config or e2v.datasets, not both"])
    where = e2v.dataset_config or "e2v.datasets"
    try:
        datasets = load_e2v_dataset_configs(e2v.dataset_config or {"datasets": e2v.datasets})
    except ConfigError as error:
        raise ConfigError([f"{where}: {problem}" for problem in error.problems]) from None
    resolved, problems, notices = [], [], []
    for index, dataset in enumerate(datasets):
        data = dataset.model_dump()
        vae = data["processors"]["vae"]
        if e2v.frame_conditioning:
            vae["frame_conditioning"] = e2v.frame_conditioning
        if e2v.frame_index is not None:
            vae["frame_index"] = e2v.frame_index
        if e2v.concatenate_mask is not None:
            vae["concatenate_mask"] = e2v.concatenate_mask
        if e2v.e2v_type:
            data["e2v_type"] = e2v.e2v_type
        if e2v.resolution is not None:
            data["target_resolution"] = vae["resolution"] = e2v.resolution
        try:
            dataset = E2VDatasetConfig.model_validate(data)
        except ValidationError as error:
            problems += [f"e2v datasets.{index}.{problem}" for problem in format_validation_error(error)]
            continue
        dataset, rounded = round_to_spatial_unit(dataset, spatial_unit, f"{where}: datasets.{index}.")
        notices += rounded
        if not Path(dataset.data_root).is_dir():
            problems.append(f"e2v datasets.{index}.data_root: {dataset.data_root!r} is not a folder")
        resolved.append(dataset)
    if problems:
        raise ConfigError(problems)
    for notice in notices:
        log.warning("notice: %s", notice)
    first = resolved[0]
    for index, dataset in enumerate(resolved[1:], start=1):
        same = (dataset.elements_in_position_order(), dataset.processors, dataset.e2v_type, dataset.reference_frames)
        if same != (first.elements_in_position_order(), first.processors, first.e2v_type, first.reference_frames):
            problems.append(f"e2v datasets.{index}: its elements, processors, e2v_type and reference_frames must "
                            f"equal those of datasets.0 (one model learns one condition layout)")
    if problems:
        raise ConfigError(problems)
    return resolved


def e2v_frame_buckets(dataset: E2VDatasetConfig, configured: list[int]) -> list[int]:
    """The frame buckets an E2V run uses: a bucket too short for the reference frames (and, when they are prepended,
    one frame of the clip) is no candidate. auto_frame_buckets: every 4k+1 count from the first that holds them up to
    the largest configured bucket, so each clip trains at the longest 4k+1 it fills; otherwise only the largest
    configured bucket. Empty when even the largest configured bucket is too short."""
    first, largest = min_clip_frames(dataset), max(configured)
    if not dataset.auto_frame_buckets:
        return [largest] if largest >= first else []
    return list(range(first, largest + 1, 4))


def apply_e2v_data_settings(config: TrainConfig, dataset: E2VDatasetConfig) -> None:
    """The target resolution becomes the only resolution bucket; the frame buckets are e2v_frame_buckets'. Raises
    ConfigError when no configured bucket can hold the reference frames."""
    height, width = dataset.target_resolution
    buckets = e2v_frame_buckets(dataset, config.data.frame_buckets)
    if not buckets:
        raise ConfigError([f"data.frame_buckets: the largest bucket ({max(config.data.frame_buckets)} frames) cannot "
                           f"hold the E2V reference frames ({' + '.join(map(str, dataset.repeats()))} = "
                           f"{dataset.num_reference_frames}) and a frame of the clip; the shortest usable bucket "
                           f"is {min_clip_frames(dataset)}"])
    try:  # the data section's bounds hold for the values derived here too
        config.data.resolution = round(math.sqrt(height * width))
        config.data.aspect_ratios = [width / height]
        config.data.frame_buckets = buckets
    except ValidationError as error:
        raise ConfigError([f"e2v datasets.0.target_resolution: {[height, width]} makes a training bucket the data "
                           f"section refuses ({problem})" for problem in format_validation_error(error)]) from None
