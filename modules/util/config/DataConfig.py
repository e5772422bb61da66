from typing import Annotated, Literal

from pydantic import Field, field_validator

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.ControlConfig import ControlConfig
from modules.util.config.bounds import (MAX_ASPECT_RATIO, MAX_BALANCING, MAX_FPS, MAX_FRAMES, MAX_LIST,
                                         MAX_REPEATS, MAX_SIDE, MIN_ASPECT_RATIO, PathText, Seed)
from modules.util.resolution import parse_resolution


def check_resolution(value: int | str) -> int | str:
    size = parse_resolution(value)
    if max(size or (int(value),)) > MAX_SIDE:
        raise ValueError(f"{value!r}: a side (or an integer resolution) is at most {MAX_SIDE}")
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def check_frame_buckets(value: list[int]) -> list[int]:
    bad = [f for f in value if f < 1 or f > MAX_FRAMES or (f - 1) % 4 != 0]
    if bad or not value:
        raise ValueError(f"every frame bucket must be 4k+1 (1, 5, 9, ... {MAX_FRAMES}); got {bad or 'an empty list'}")
    return sorted(set(value))


AspectRatio = Annotated[float, Field(ge=MIN_ASPECT_RATIO, le=MAX_ASPECT_RATIO)]


class ConceptConfig(BaseConfig):
    """One input: a folder of videos and images, or a jsonl manifest."""

    name: str = ""
    path: PathText = Field(..., min_length=1, description="a folder, or a .jsonl manifest")
    enabled: bool = True
    include_subdirectories: bool = False
    repeats: float = Field(1.0, gt=0, le=MAX_REPEATS)
    balancing: int | None = Field(None, ge=1, le=MAX_BALANCING, description="items per epoch, overrides repeats")
    loss_weight: float = Field(1.0, ge=0)
    seed: Seed = 0
    caption_source: Literal["sidecar", "filename", "prompt_file"] = "sidecar"
    caption_extension: str = Field(".txt", pattern=r"^\.[^/\\]+$",
                                   description="the sidecar caption file's extension (caption_source 'sidecar')")
    prompt_path: PathText = ""
    caption_required: bool = True
    caption_dropout: float = Field(0.0, ge=0, le=1)
    remove_common_llm_caption_prefixes: bool = Field(False, description="drop captioning LLMs' openings (\"The "
                                                     "video shows\", \"In this video,\") from the captions")
    fps: int | Literal["model", "source"] = Field(
        "model", description=f"frames per second to resample to (1..{MAX_FPS}), 'model' or 'source'")
    extraction: Literal["head", "uniform", "random", "slide", "chunk", "spaced", "full"] = "head"
    slide_stride: int = Field(16, ge=1, le=MAX_FRAMES, description="pixel frames between windows in slide mode")
    window_count: int = Field(1, ge=1, le=MAX_FRAMES, description="windows per clip in spaced mode")
    mask_path: PathText = Field("", description="a folder of loss masks named as the media files (any image or "
                                "video extension; white = learn, black = ignore), as diffusion-pipe's mask_path; a "
                                "mask beside a clip as <name>_mask.<ext> is found without it (docs/masks.md)")
    control_path: PathText = Field("", description="control models (VACE): a folder of control videos (or folders of "
                                   "frames) named as the media files (musubi-tuner's control_directory, diffusion-pipe's "
                                   "control_path); a <name>_control beside a clip wins (docs/vace.md)")
    default_mask: PathText = Field("", description="a mask for every file of this concept that has none of its own "
                                   "(diffusion-pipe's default_mask_file)")
    mask_required: bool = Field(False, description="skip (with a warning, counted) the files of this concept that "
                                "have no mask (blissful-tuner's require_mask)")
    validation: bool = Field(False, description="hold every item of this concept out of training for the "
                             "validation loss (docs/validation.md)")
    max_frames: int = Field(81, ge=1, le=MAX_FRAMES)
    target_frames: list[int] = Field([], max_length=MAX_LIST, description="every listed frame count that a clip "
                                     "holds makes its own item(s) (musubi-tuner's target_frames); empty: one count "
                                     "per clip, the largest data.frame_buckets bucket that fits")
    frame_folders: bool = Field(False, description="read each sub-folder holding images as one clip, its images "
                                "the frames in name order (musubi-tuner's video_directory)")
    frames_fps: float | None = Field(None, gt=0, le=MAX_FPS, description="the frame rate of a folder of images "
                                     "read as a clip (musubi-tuner's source_fps); null: every image one frame, as "
                                     "stored")
    # diffusion-pipe's per-directory buckets (docs/data.md); null: the data section's
    resolution: int | str | None = Field(None, description="this concept's own data.resolution; null: data.resolution")
    aspect_ratios: list[AspectRatio] | None = Field(None, min_length=1, max_length=MAX_LIST, description="this "
                                                    "concept's own data.aspect_ratios; null: data.aspect_ratios")
    frame_buckets: list[int] | None = Field(None, max_length=MAX_LIST, description="this concept's own "
                                            "data.frame_buckets; null: data.frame_buckets")

    @field_validator("resolution")
    @classmethod
    def _own_resolution(cls, value: int | str | None) -> int | str | None:
        return None if value is None else check_resolution(value)

    @field_validator("frame_buckets")
    @classmethod
    def _own_frame_buckets(cls, value: list[int] | None) -> list[int] | None:
        return None if value is None else check_frame_buckets(value)

    @field_validator("target_frames")
    @classmethod
    def _targets_are_4k_plus_1(cls, value: list[int]) -> list[int]:
        bad = [f for f in value if f < 1 or f > MAX_FRAMES or (f - 1) % 4 != 0]
        if bad:
            raise ValueError(f"every target frame count must be 4k+1 (1, 5, 9, ... {MAX_FRAMES}); got {bad}")
        return sorted(set(value))

    @field_validator("fps", mode="before")
    @classmethod
    def _fps_a_video_can_have(cls, value):
        # before the int | Literal union, so a wrong value gets one message instead of one per union member
        if type(value) is float and value.is_integer():
            value = int(value)
        if value in ("model", "source") or (type(value) is int and 1 <= value <= MAX_FPS):
            return value
        raise ValueError(f"a frame rate is a whole number 1..{MAX_FPS} (frames per second), 'model' or 'source'")


class DataConfig(BaseConfig):
    concepts: list[ConceptConfig] = []
    dataset_config: PathText = Field("", description="a musubi-tuner or diffusion-pipe dataset TOML: its datasets "
                                     "are added to the concepts and its settings replace the data section's "
                                     "(docs/data.md)")
    frame_buckets: list[int] = Field([1, 17, 33, 49, 81], max_length=MAX_LIST)
    resolution: int | str = Field("480p", description="'480p' (832x480) or '720p' (1280x720): 16:9 clips train at "
                                  "exactly that size; 'WxH' likewise; an integer N: every bucket has the area N x N "
                                  f"(docs/configuration.md has the table); sides at most {MAX_SIDE}")
    aspect_ratios: list[Annotated[float, Field(ge=MIN_ASPECT_RATIO, le=MAX_ASPECT_RATIO)]] = Field(
        [16 / 9, 4 / 3, 1.0, 3 / 4, 9 / 16], min_length=1, max_length=MAX_LIST,
        description="width / height of the buckets, each 1/16..16")
    no_upscale: bool = False
    crop_jitter: bool = False
    flip: bool = False
    validation_split: float = Field(0.0, ge=0, lt=1, description="hold out this fraction of each concept's files "
                                    "for the validation loss, chosen by file name (the same files on every run)")
    dataloader_threads: int = Field(2, ge=0, le=256)
    ti2v_image_probability: float = Field(0.5, ge=0, le=1, description="Wan 2.2 TI2V-5B: share of batches trained "
                                          "image-to-video (first latent frame clean)")
    control: ControlConfig = Field(default_factory=ControlConfig, description="control models (VACE): derived "
                                   "controls and the loss region (docs/vace.md)")

    @field_validator("resolution")
    @classmethod
    def _known_resolution(cls, value: int | str) -> int | str:
        return check_resolution(value)

    @field_validator("frame_buckets")
    @classmethod
    def _frames_are_4k_plus_1(cls, value: list[int]) -> list[int]:
        return check_frame_buckets(value)
