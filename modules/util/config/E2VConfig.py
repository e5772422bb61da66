"""Elements-to-Video dataset configuration (DESIGN.md section 6): the user's JSON, accepted as written.

Two spellings map onto one internal form (`E2VDatasetConfig`):

- nested (seeds 000 / 001): `elements[].vae: {repeat, position, preprocess?}`, `elements[].clip: {preprocess} | false`,
  `processors: {vae: {...}, clip: {...}}`;
- flat (seed 002): `elements[].vae_repeat`, `elements[].position`, `elements[].clip_process` (a mode or false), and
  top-level `clip_resolution`, `vae_combine` (plus `vae_resolution`, `vae_default_preprocess`,
  `clip_default_preprocess`, `frame_conditioning`, `frame_index`, `concatenate_mask`).

Either may come wrapped as `{"datasets": [...]}` or as one dataset object. `processors.vae.resolution` defaults to
`target_resolution`. Errors are `ConfigError` problems that name the field as the user wrote it
(`datasets.0.elements.1.vae.position: ...`, or `...elements.1.vae_repeat: ...` in the flat form).

Positions are slot indices: N elements use positions 0..N-1 exactly once. Slot k's reference frames start at the
sum of the repeats of slots 0..k-1 (a missing optional element leaves its slot empty; slots never shift).
"""
from __future__ import annotations

import logging
import os
import re
import string
from typing import Annotated, Any, Literal

from pydantic import (Field, ValidationError, ValidationInfo, field_serializer, field_validator,
                      model_validator)

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.ConfigError import ConfigError
from modules.util.config.bounds import MAX_FRAMES, MAX_SIDE, PathText
from modules.util.config.json_files import read_json_file
from modules.util.config.validation_problems import format_validation_error

logger = logging.getLogger(__name__)

# a2 / a2_pad / a2_crop: SkyReels-A2's own inference preprocessing (modules/model/e2v_condition.py)
PreprocessMode = Literal["resize", "center_crop", "pad_white", "letterbox", "a2", "a2_pad", "a2_crop"]
ReshapeMode = Literal["bicubic", "bilinear", "area", "nearest"]
FrameConditioning = Literal["full", "index", "prefix", "random", "first_and_last"]
CombineMode = Literal["before", "after"]
E2VType = Literal["vae", "clip", "dual"]
VisualizationData = Literal["input_latents", "noisy_latents", "conditioned_latents", "predicted_latents",
                            "reference_images"]
Side = Annotated[int, Field(ge=1, le=MAX_SIDE)]
Resolution = tuple[Side, Side]   # [height, width]

# The Wan VAEs (2.1 and 2.2) encode frame 0 alone, then chunks of this many frames.
VAE_TEMPORAL_STRIDE = 4
# A validation context key: load_e2v_dataset_configs runs the cross-field checks itself, with exact field paths.
_DEFER_CHECKS = "e2v_defer_checks"


def aligned_repeats(count: int, stride: int = VAE_TEMPORAL_STRIDE) -> list[int]:
    """The repeats that put slot k exactly in latent frame k: 1 for the first slot, `stride` for the others."""
    return [1] + [stride] * (count - 1) if count > 0 else []


# --- the internal form -----------------------------------------------------------------------------------------

class E2VElementVaeConfig(BaseConfig):
    repeat: int = Field(1, ge=1, le=MAX_FRAMES, description="consecutive mini-video frames this element occupies")
    position: int = Field(..., ge=0, le=1024, description="slot index: order in the mini-video and the CLIP tokens")
    preprocess: PreprocessMode | None = Field(None, description="None: processors.vae.default_preprocess")


class E2VElementClipConfig(BaseConfig):
    preprocess: PreprocessMode | None = Field(None, description="None: processors.clip.default_preprocess")


class E2VElementConfig(BaseConfig):
    name: str = Field(..., min_length=1)
    suffixes: list[Annotated[str, Field(min_length=1)]] = Field(..., min_length=1,
                                                                description="first existing file wins")
    required: bool = False
    vae: E2VElementVaeConfig
    clip: E2VElementClipConfig | None = Field(default_factory=E2VElementClipConfig,
                                              description="None (written false): no CLIP tokens for this element")

    @field_validator("clip", mode="before")
    @classmethod
    def _clip_flag(cls, value: Any) -> Any:
        if value is False:
            return None
        if value is True:
            return {}
        return value

    @field_serializer("clip")
    def _clip_false(self, value: E2VElementClipConfig | None):
        return False if value is None else value.model_dump()


class VaeProcessorConfig(BaseConfig):
    resolution: Resolution = Field(..., description="[height, width]; defaults to the dataset's target_resolution")
    combine: CombineMode = "before"
    default_preprocess: PreprocessMode = "resize"
    frame_conditioning: FrameConditioning = "full"
    frame_index: int = Field(0, ge=0, le=1024)
    concatenate_mask: bool = True


class ClipProcessorConfig(BaseConfig):
    resolution: Resolution = (512, 512)
    default_preprocess: PreprocessMode = "center_crop"


class E2VProcessorsConfig(BaseConfig):
    vae: VaeProcessorConfig
    clip: ClipProcessorConfig = ClipProcessorConfig()


class VisualizationProcessorConfig(BaseConfig):
    type: Literal["latent_save", "vae_decode"]
    data: list[VisualizationData] = Field(..., min_length=1)
    frames: list[int] | None = Field(None, description="frame indices to keep (negative counts from the end)")
    format: Literal["safetensors", "pt", "png"] = Field(..., description="latent_save: safetensors (default) or "
                                                        "pt; vae_decode: png")

    @model_validator(mode="before")
    @classmethod
    def _default_format(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("format") is None and "type" in data:
            data = {**data, "format": "png" if data["type"] == "vae_decode" else "safetensors"}
        return data

    @model_validator(mode="after")
    def _format_fits_type(self) -> VisualizationProcessorConfig:
        allowed = ("png",) if self.type == "vae_decode" else ("safetensors", "pt")
        if self.format not in allowed:
            raise ValueError(f"format {self.format!r} does not fit type {self.type!r} (allowed: {', '.join(allowed)})")
        return self


class VisualizationConfig(BaseConfig):
    enabled: bool = False
    output_dir: PathText = Field("visualizations/{run_id}", description="{run_id} expands to the run's id")
    frequency: int = Field(100, ge=1, description="every this many steps")
    processors: list[VisualizationProcessorConfig] = []

    @field_validator("output_dir")
    @classmethod
    def _only_run_id(cls, value: str) -> str:
        try:
            names = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as e:
            raise ValueError(f"not a valid template: {e}") from None
        unknown = names - {"run_id"}
        if unknown:
            raise ValueError(f"unknown placeholder(s) {sorted(unknown)}; only {{run_id}} expands")
        return value

    def resolved_output_dir(self, run_id: str) -> str:
        return self.output_dir.replace("{run_id}", run_id)


class E2VDatasetConfig(BaseConfig):
    data_root: PathText = Field(..., min_length=1)
    dataset_type: Literal["e2v"] = "e2v"
    target_resolution: Resolution = Field(..., description="[height, width]")
    auto_frame_buckets: bool = True
    reshape_mode: ReshapeMode = "bicubic"
    remove_common_llm_caption_prefixes: bool = False
    elements: list[E2VElementConfig] = Field(..., min_length=1)
    processors: E2VProcessorsConfig
    visualization: VisualizationConfig = VisualizationConfig()
    e2v_type: E2VType = Field("dual", description="which pathways condition the model: vae, clip or both")
    reference_frames: Literal["prepend", "overlay"] = Field(
        "prepend", description="prepend: the target starts with the reference frames (A2); overlay: the clip as is")
    reference_loss: Literal["include", "exclude"] = Field(
        "include", description="exclude: no loss on the latent frames that hold reference frames")

    @model_validator(mode="before")
    @classmethod
    def _vae_resolution_from_target(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "target_resolution" not in data:
            return data
        processors = data.get("processors", {})
        if not isinstance(processors, dict):
            return data
        vae = processors.get("vae", {})
        if isinstance(vae, dict) and "resolution" not in vae:
            data = {**data, "processors": {**processors, "vae": {**vae, "resolution": data["target_resolution"]}}}
        return data

    @model_validator(mode="after")
    def _cross_field_checks(self, info: ValidationInfo) -> E2VDatasetConfig:
        if info.context and info.context.get(_DEFER_CHECKS):
            return self
        problems = dataset_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ---- derived values ----

    def elements_in_position_order(self) -> list[E2VElementConfig]:
        return sorted(self.elements, key=lambda element: element.vae.position)

    def repeats(self) -> list[int]:
        """Per slot, in position order."""
        return [element.vae.repeat for element in self.elements_in_position_order()]

    @property
    def num_reference_frames(self) -> int:
        return sum(self.repeats())

    @property
    def uses_vae(self) -> bool:
        return self.e2v_type in ("vae", "dual")

    @property
    def uses_clip(self) -> bool:
        return self.e2v_type in ("clip", "dual")

    @property
    def repeats_aligned(self) -> bool:
        return self.repeats() == aligned_repeats(len(self.elements))

    def vae_preprocess(self, element: E2VElementConfig) -> str:
        return element.vae.preprocess or self.processors.vae.default_preprocess

    def clip_preprocess(self, element: E2VElementConfig) -> str | None:
        """None when the element takes no part in the CLIP pathway."""
        if element.clip is None or not self.uses_clip:
            return None
        return element.clip.preprocess or self.processors.clip.default_preprocess

    def condition_channels(self, latent_channels: int = 16, stride: int = VAE_TEMPORAL_STRIDE) -> int:
        """Channels concatenated to the noisy latents: mask (`stride`) + latents, or latents only."""
        return latent_channels + (stride if self.processors.vae.concatenate_mask else 0)


# --- checks ----------------------------------------------------------------------------------------------------

def dataset_problems(config: E2VDatasetConfig) -> list[str]:
    """Cross-field problems, as 'dotted.field: message' relative to the dataset."""
    problems = []
    count = len(config.elements)
    names: dict[str, int] = {}
    positions: dict[int, int] = {}
    suffixes: dict[str, int] = {}
    for index, element in enumerate(config.elements):
        if element.name in names:
            problems.append(f"elements.{index}.name: {element.name!r} is already the name of "
                            f"elements.{names[element.name]}")
        names.setdefault(element.name, index)
        position = element.vae.position
        if position in positions:
            other = positions[position]
            problems.append(f"elements.{index}.vae.position: {position} is already the position of element "
                            f"{config.elements[other].name!r} (elements.{other}); each slot holds one element")
        elif position >= count:
            problems.append(f"elements.{index}.vae.position: {position} is not a slot of {count} element(s); positions "
                            f"are slot indices 0..{count - 1}")
        positions.setdefault(position, index)
        for suffix in element.suffixes:
            if suffix in suffixes and suffixes[suffix] != index:
                problems.append(f"elements.{index}.suffixes: {suffix!r} is also a suffix of element "
                                f"{config.elements[suffixes[suffix]].name!r}; a file must belong to one element")
            suffixes.setdefault(suffix, index)
    vae = config.processors.vae
    if vae.frame_conditioning in ("index", "prefix") and vae.frame_index >= count:
        problems.append(f"processors.vae.frame_index: {vae.frame_index} is not a slot of {count} element(s) "
                        f"(frame_conditioning {vae.frame_conditioning!r} needs 0..{count - 1})")
    if config.uses_clip and all(element.clip is None for element in config.elements):
        problems.append(f"e2v_type: {config.e2v_type!r} uses the CLIP pathway, but every element has clip: false")
    return problems


def check_against_frames(config: E2VDatasetConfig, num_frames: int, prefix: str = "") -> None:
    """Raises ConfigError when the reference frames do not fit a clip of `num_frames` pixel frames."""
    problems = []
    stride = VAE_TEMPORAL_STRIDE
    if not (config.uses_vae or config.reference_frames == "prepend"):
        return
    if num_frames < 1 or (num_frames - 1) % stride:
        raise ConfigError([f"{prefix}num_frames: {num_frames} is not {stride}k+1 (1, 5, 9, ... 81)"])
    latent_frames = (num_frames - 1) // stride + 1
    total = 0
    ordered = config.elements_in_position_order()
    for element in ordered:
        total += element.vae.repeat
        if total > num_frames:
            index = config.elements.index(element)
            repeats = " + ".join(str(r) for r in config.repeats())
            problems.append(f"{prefix}elements.{index}.vae.repeat: the reference frames ({repeats} = "
                            f"{config.num_reference_frames}, in position order) do not fit the {num_frames} frames "
                            f"of the clip; element {element.name!r} starts or ends past its end")
            break
    if config.processors.vae.combine == "after" and len(ordered) > latent_frames:
        index = config.elements.index(ordered[latent_frames])
        problems.append(f"{prefix}elements.{index}.vae.position: latent frame {latent_frames} does not exist in a "
                        f"{num_frames}-frame clip ({latent_frames} latent frames); combine 'after' puts element k "
                        f"at latent frame k")
    if problems:
        raise ConfigError(problems)


def min_clip_frames(config: E2VDatasetConfig, stride: int = VAE_TEMPORAL_STRIDE) -> int:
    """The fewest pixel frames (a stride*k+1 count) a training clip needs: room for every reference frame, plus at
    least one frame of the clip itself when the references are prepended to the target; with combine 'after', one
    latent frame per element."""
    if not (config.uses_vae or config.reference_frames == "prepend"):
        return 1
    needed = config.num_reference_frames + (1 if config.reference_frames == "prepend" else 0)
    if config.processors.vae.combine == "after":
        needed = max(needed, stride * (len(config.elements) - 1) + 1)
    return -(-(needed - 1) // stride) * stride + 1


def round_to_spatial_unit(config: E2VDatasetConfig, spatial_unit: int, prefix: str = ""
                          ) -> tuple[E2VDatasetConfig, list[str]]:
    """Rounds each side of target_resolution and processors.vae.resolution to the nearest multiple of the model's
    spatial unit (VAE stride x patch: 16 for Wan 2.1 and A14B, 32 for TI2V-5B; never below one unit), as a user who
    writes 480x854 (16:9 of 480) means 480x848. Returns the config and one notice per changed field, naming the
    field, the value written and the value used."""
    def rounded(side: int) -> int:
        return max(spatial_unit, (2 * side + spatial_unit) // (2 * spatial_unit) * spatial_unit)

    data = config.model_dump()
    notices = []
    for field, path in (("target_resolution", ("target_resolution",)),
                        ("processors.vae.resolution", ("processors", "vae", "resolution"))):
        node = data
        for part in path[:-1]:
            node = node[part]
        written = tuple(node[path[-1]])
        used = tuple(rounded(side) for side in written)
        if used != written:
            node[path[-1]] = used
            notices.append(f"{prefix}{field}: {list(written)} is not a multiple of the model's spatial unit "
                           f"({spatial_unit}); using {list(used)}")
    if not notices:
        return config, []
    return E2VDatasetConfig.model_validate(data), notices


def warn_if_unaligned(config: E2VDatasetConfig, where: str = "") -> bool:
    """Logs one warning when the repeats do not put slot k in latent frame k; returns whether it warned."""
    if config.repeats_aligned or not (config.uses_vae or config.reference_frames == "prepend"):
        return False
    label = where or config.data_root
    logger.warning("E2V dataset %s: repeats %s (in position order) are not aligned to the VAE's frame chunks "
                   "(aligned: %s). They are honoured as written, but reference slots straddle latent frames, so "
                   "element k does not land in latent frame k; the aligned layout is recommended.",
                   label, ", ".join(map(str, config.repeats())),
                   ", ".join(map(str, aligned_repeats(len(config.elements)))))
    return True


# --- loading (nested and flat forms) ---------------------------------------------------------------------------

_FLAT_ELEMENT_KEYS = {"vae_repeat": ("vae", "repeat"), "position": ("vae", "position"),
                      "vae_preprocess": ("vae", "preprocess")}
_FLAT_TOP_KEYS = {"clip_resolution": ("clip", "resolution"), "clip_default_preprocess": ("clip", "default_preprocess"),
                  "vae_combine": ("vae", "combine"), "vae_resolution": ("vae", "resolution"),
                  "vae_default_preprocess": ("vae", "default_preprocess"),
                  "frame_conditioning": ("vae", "frame_conditioning"), "frame_index": ("vae", "frame_index"),
                  "concatenate_mask": ("vae", "concatenate_mask")}


def _normalize_dataset(raw: dict) -> tuple[dict, dict[str, str], list[str]]:
    """Maps the flat form onto the nested one. Returns (data, aliases internal path -> user path, problems)."""
    data = dict(raw)
    aliases: dict[str, str] = {}
    problems: list[str] = []
    elements = data.get("elements")
    if isinstance(elements, list):
        normalized = []
        for index, element in enumerate(elements):
            if not isinstance(element, dict):
                normalized.append(element)
                continue
            element = dict(element)
            flat = [key for key in _FLAT_ELEMENT_KEYS if key in element]
            if flat:
                if "vae" in element:
                    problems.append(f"elements.{index}: {', '.join(flat)} and vae are two spellings of the same "
                                    f"settings; use one")
                vae = {}
                for key in flat:
                    vae[_FLAT_ELEMENT_KEYS[key][1]] = element.pop(key)
                    aliases[f"elements.{index}.vae.{_FLAT_ELEMENT_KEYS[key][1]}"] = f"elements.{index}.{key}"
                for key, (_, field) in _FLAT_ELEMENT_KEYS.items():
                    aliases.setdefault(f"elements.{index}.vae.{field}", f"elements.{index}.{key}")
                aliases[f"elements.{index}.vae"] = f"elements.{index}"
                element.setdefault("vae", vae)
            if "clip_process" in element:
                if "clip" in element:
                    problems.append(f"elements.{index}: clip_process and clip are two spellings of the same "
                                    f"setting; use one")
                value = element.pop("clip_process")
                element.setdefault("clip", value if isinstance(value, bool) else {"preprocess": value})
                aliases[f"elements.{index}.clip.preprocess"] = f"elements.{index}.clip_process"
                aliases[f"elements.{index}.clip"] = f"elements.{index}.clip_process"
            normalized.append(element)
        data["elements"] = normalized
    flat_top = [key for key in _FLAT_TOP_KEYS if key in data]
    if flat_top:
        processors = data.get("processors", {})
        if not isinstance(processors, dict):
            return data, aliases, problems
        processors = {name: dict(section) if isinstance(section, dict) else section
                      for name, section in processors.items()}
        for key in flat_top:
            section, field = _FLAT_TOP_KEYS[key]
            target = processors.setdefault(section, {})
            if not isinstance(target, dict):
                continue
            if field in target:
                problems.append(f"{key}: processors.{section}.{field} is set too; use one")
            target[field] = data.pop(key)
            aliases[f"processors.{section}.{field}"] = key
        data["processors"] = processors
    return data, aliases, problems


def _apply_aliases(problem: str, aliases: dict[str, str]) -> str:
    path, sep, message = problem.partition(": ")
    best = max((key for key in aliases if path == key or path.startswith(key + ".")), key=len, default=None)
    if best is None:
        return problem
    return aliases[best] + path[len(best):] + sep + message


def _validate_dataset(raw: Any, prefix: str) -> tuple[E2VDatasetConfig | None, list[str]]:
    if not isinstance(raw, dict):
        return None, [f"{prefix.rstrip('.') or '(top level)'}: a dataset must be a JSON object, not "
                      f"{type(raw).__name__}"]
    data, aliases, problems = _normalize_dataset(raw)
    try:
        config = E2VDatasetConfig.model_validate(data, context={_DEFER_CHECKS: True})
    except ValidationError as e:
        problems += format_validation_error(e)
        return None, [prefix + _apply_aliases(p, aliases) for p in problems]
    problems += dataset_problems(config)
    return (None if problems else config), [prefix + _apply_aliases(p, aliases) for p in problems]


def load_e2v_dataset_configs(source: str | os.PathLike | dict | list) -> list[E2VDatasetConfig]:
    """A JSON file path, a parsed object `{"datasets": [...]}`, a list of datasets, or one dataset object ->
    validated configs. Raises ConfigError with every problem; warns (logging) about unaligned repeats."""
    where = ""
    if isinstance(source, (str, os.PathLike)):
        where = str(source)
        source = read_json_file(source, "E2V config")
    if isinstance(source, dict) and "datasets" in source:
        extra = sorted(set(source) - {"datasets"})
        if extra:
            raise ConfigError([f"{key}: unknown key next to datasets" for key in extra], where)
        datasets, prefix = source["datasets"], "datasets."
        if not isinstance(datasets, list) or not datasets:
            raise ConfigError(["datasets: must be a non-empty list of dataset objects"], where)
    elif isinstance(source, list):
        datasets, prefix = source, "datasets."
        if not datasets:
            raise ConfigError(["datasets: must be a non-empty list of dataset objects"], where)
    elif isinstance(source, dict):
        datasets, prefix = [source], ""
    else:
        raise ConfigError([f"(top level): expected a JSON object, not {type(source).__name__}"], where)

    configs, problems = [], []
    for index, raw in enumerate(datasets):
        dataset_prefix = f"{prefix}{index}." if prefix else ""
        config, found = _validate_dataset(raw, dataset_prefix)
        problems += found
        if config is not None:
            configs.append(config)
    if problems:
        raise ConfigError(problems, where)
    for index, config in enumerate(configs):
        warn_if_unaligned(config, f"{prefix}{index} ({config.data_root})" if prefix else config.data_root)
    return configs


# --- captions --------------------------------------------------------------------------------------------------

_SUBJECT = r"(?:the|this)\s+(?:video|clip|footage|scene)\b"
_VERB = r"(?:shows|depicts|features|captures|showcases|presents|displays|illustrates|portrays)\b"
_LLM_PREFIX = re.compile(
    rf"^\s*(?:in\s+{_SUBJECT}\s*,?|{_SUBJECT}\s+(?:begins\s+with|opens\s+with|{_VERB})(?:\s+that\b)?)[\s,:]*",
    re.IGNORECASE)


def strip_llm_caption_prefix(text: str) -> str:
    """Drops the boilerplate openings that captioning LLMs write ("The video shows", "In this video,", "This video
    depicts", "The video features", "The video captures", "In the video,", ...) and re-capitalises the first letter.
    Text without such an opening, or that would be left empty, comes back unchanged."""
    match = _LLM_PREFIX.match(text)
    if not match:
        return text
    rest = text[match.end():]
    if not rest.strip():
        return text
    return rest[0].upper() + rest[1:]
