from typing import Literal

from pydantic import Field, field_validator

from modules.util.config.BaseConfig import BaseConfig
from modules.util.resolution import parse_resolution


class ConceptConfig(BaseConfig):
    """One input: a folder of videos and images, or a jsonl manifest."""

    name: str = ""
    path: str = Field(..., description="a folder, or a .jsonl manifest")
    enabled: bool = True
    include_subdirectories: bool = False
    repeats: float = Field(1.0, gt=0)
    balancing: int | None = Field(None, ge=1, description="items per epoch, overrides repeats")
    loss_weight: float = Field(1.0, ge=0)
    seed: int = 0
    caption_source: Literal["sidecar", "filename", "prompt_file"] = "sidecar"
    caption_extension: str = Field(".txt", pattern=r"^\.[^/\\]+$",
                                   description="the sidecar caption file's extension (caption_source 'sidecar')")
    prompt_path: str = ""
    caption_required: bool = True
    caption_dropout: float = Field(0.0, ge=0, le=1)
    remove_common_llm_caption_prefixes: bool = Field(False, description="drop captioning LLMs' openings (\"The "
                                                     "video shows\", \"In this video,\") from the captions")
    fps: int | Literal["model", "source"] = "model"
    extraction: Literal["head", "uniform", "random", "slide", "chunk", "spaced", "full"] = "head"
    slide_stride: int = Field(16, ge=1, description="pixel frames between windows in slide mode")
    window_count: int = Field(1, ge=1, description="windows per clip in spaced mode")
    max_frames: int = Field(81, ge=1)
    target_frames: list[int] = Field([], description="every listed frame count that a clip holds makes its own "
                                     "item(s) (musubi-tuner's target_frames); empty: one count per clip, the largest "
                                     "data.frame_buckets bucket that fits")

    @field_validator("target_frames")
    @classmethod
    def _targets_are_4k_plus_1(cls, value: list[int]) -> list[int]:
        bad = [f for f in value if f < 1 or (f - 1) % 4 != 0]
        if bad:
            raise ValueError(f"every target frame count must be 4k+1 (1, 5, 9, ... 81); got {bad}")
        return sorted(set(value))


class DataConfig(BaseConfig):
    concepts: list[ConceptConfig] = []
    dataset_config: str = Field("", description="a musubi-tuner or diffusion-pipe dataset TOML: its datasets are "
                                "added to the concepts and its settings replace the data section's (docs/data.md)")
    frame_buckets: list[int] = [1, 17, 33, 49, 81]
    resolution: int | str = Field("480p", description="'480p' (832x480) or '720p' (1280x720): 16:9 clips train at "
                                  "exactly that size; 'WxH' likewise; an integer N: every bucket has the area N x N "
                                  "(docs/configuration.md has the table)")
    aspect_ratios: list[float] = [16 / 9, 4 / 3, 1.0, 3 / 4, 9 / 16]
    no_upscale: bool = False
    crop_jitter: bool = False
    flip: bool = False
    dataloader_threads: int = Field(2, ge=0)
    ti2v_image_probability: float = Field(0.5, ge=0, le=1, description="Wan 2.2 TI2V-5B: share of batches trained "
                                          "image-to-video (first latent frame clean)")

    @field_validator("resolution")
    @classmethod
    def _known_resolution(cls, value: int | str) -> int | str:
        parse_resolution(value)
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value

    @field_validator("frame_buckets")
    @classmethod
    def _frames_are_4k_plus_1(cls, value: list[int]) -> list[int]:
        bad = [f for f in value if f < 1 or (f - 1) % 4 != 0]
        if bad or not value:
            raise ValueError(f"every frame bucket must be 4k+1 (1, 5, 9, ... 81); got {bad or 'an empty list'}")
        return sorted(set(value))
