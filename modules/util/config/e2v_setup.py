"""Resolves a training config's E2V section into validated dataset configs with the command-line overrides
applied, and the data settings they imply (resolution, frame buckets)."""
import math
from pathlib import Path

from pydantic import ValidationError

from modules.util.config.config_io import ConfigError, format_validation_error
from modules.util.config.E2VConfig import _DEFER_CHECKS as DEFER_CHECKS
from modules.util.config.E2VConfig import E2VDatasetConfig, dataset_problems, load_e2v_dataset_configs
from modules.util.config.TrainConfig import TrainConfig


def resolve_e2v_datasets(config: TrainConfig) -> list[E2VDatasetConfig]:
    e2v = config.e2v
    if e2v.dataset_config and e2v.datasets:
        raise ConfigError(["e2v: set either e2v.dataset_config or e2v.datasets, not both"])
    try:
        datasets = load_e2v_dataset_configs(e2v.dataset_config or {"datasets": e2v.datasets})
    except ConfigError as error:
        where = e2v.dataset_config or "e2v.datasets"
        raise ConfigError([f"{where}: {problem}" for problem in error.problems]) from None
    resolved, problems = [], []
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
        # the overrides come from the command line (--frame_conditioning_index): judged like the file's own values
        found = [f"e2v datasets.{index}.{problem}" for problem in dataset_problems(E2VDatasetConfig.model_validate(
            data, context={DEFER_CHECKS: True}))]
        overrides = _override_names(e2v)
        problems += [f"{problem} (set by {', '.join(overrides)})" if overrides else problem for problem in found]
        if not found:
            resolved.append(E2VDatasetConfig.model_validate(data))
    if problems:
        raise ConfigError(problems)
    first = resolved[0]
    for index, dataset in enumerate(resolved[1:], start=1):
        same = (dataset.elements_in_position_order(), dataset.processors, dataset.e2v_type, dataset.reference_frames)
        if same != (first.elements_in_position_order(), first.processors, first.e2v_type, first.reference_frames):
            raise ConfigError([f"e2v datasets.{index}: its elements, processors, e2v_type and reference_frames must "
                               f"equal those of datasets.0 (one model learns one condition layout)"])
    for index, dataset in enumerate(resolved):
        if not Path(dataset.data_root).is_dir():
            raise ConfigError([f"e2v datasets.{index}.data_root: {dataset.data_root!r} is not a folder"])
    return resolved


def _override_names(e2v) -> list[str]:
    names = {"e2v_type": e2v.e2v_type, "frame_conditioning": e2v.frame_conditioning,
             "frame_index": e2v.frame_index, "concatenate_mask": e2v.concatenate_mask}
    return [f"e2v.{name}={value}" for name, value in names.items() if value not in ("", None)]


def apply_e2v_data_settings(config: TrainConfig, dataset: E2VDatasetConfig) -> None:
    """The target resolution becomes the only resolution bucket. auto_frame_buckets: each clip goes to the largest
    frame bucket it fills; without it only the largest bucket is used (shorter clips are skipped and counted)."""
    height, width = dataset.target_resolution
    try:  # the data section's bounds hold for the values derived here too
        config.data.resolution = round(math.sqrt(height * width))
        config.data.aspect_ratios = [width / height]
    except ValidationError as error:
        raise ConfigError([f"e2v datasets.0.target_resolution: {[height, width]} makes a training bucket the data "
                           f"section refuses ({problem})" for problem in format_validation_error(error)]) from None
    if not dataset.auto_frame_buckets:
        config.data.frame_buckets = [max(config.data.frame_buckets)]
