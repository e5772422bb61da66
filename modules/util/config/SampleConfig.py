from typing import Literal

from pydantic import Field, field_validator

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import MAX_FRAMES, MAX_SIDE, PathText, Seed

# Wan's default negative prompt (wan/configs/shared_config.py `sample_neg_prompt` in the official Wan 2.1 / 2.2
# repositories; the diffusers Wan docs use the same text). Used whenever a sample's negative prompt is empty.
WAN_DEFAULT_NEGATIVE_PROMPT = (
    "色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，低质量，JPEG压缩残留，"
    "丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，毁容的，形态畸形的肢体，手指融合，"
    "静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走"
)

SamplerScheduler = Literal["UNIPC", "EULER"]


class SampleConfig(BaseConfig):
    """One preview / inference sample. Fields left unset take the caller's defaults (`with_defaults`): the training
    config's sampling section during training, the command line in scripts/sample.py."""

    enabled: bool = True
    prompt: str = ""
    negative_prompt: str = Field("", description="empty: Wan's default negative prompt")
    width: int = Field(832, ge=1, le=MAX_SIDE, description="rounded to the model's spatial unit (16, or 32 for TI2V-5B)")
    height: int = Field(480, ge=1, le=MAX_SIDE, description="rounded to the model's spatial unit (16, or 32 for TI2V-5B)")
    frames: int = Field(81, ge=1, le=MAX_FRAMES, description="rounded to 4k+1")
    steps: int = Field(20, ge=1, le=1000)
    guidance: float = Field(5.0, ge=0, description="classifier-free guidance; 1 or less disables it")
    guidance_2: float | None = Field(None, ge=0, description="Wan 2.2 A14B low-noise expert; None: same as guidance")
    seed: Seed = 42
    flow_shift: float | None = Field(None, gt=0, description="None: the model's scheduler config")
    scheduler: SamplerScheduler = "UNIPC"
    image: PathText = Field("", description="first frame (I2V, FLF2V, I2V-A14B, TI2V-5B image-to-video)")
    last_image: PathText = Field("", description="last frame (FLF2V, I2V-A14B)")
    elements: dict[str, PathText] = Field({}, description="E2V reference images, element name -> image path")
    drop_reference_frames: bool = Field(False, description="E2V: drop the leading reference frames (the sum of the "
                                        "repeats) from the saved video, as SkyReels-A2's inference does")
    control_video: PathText = Field("", description="VACE: control video (or folder of frames), at least `frames` long")
    reference_images: list[PathText] = Field([], description="VACE: reference images, in order")
    control_scale: float = Field(1.0, ge=0, description="VACE: strength of the control (vace_context_scale)")
    # Wan2.2-Animate (docs/animate.md): the video is as long as the pose video, generated in segments of `frames`
    reference_image: PathText = Field("", description="Animate: the character to animate")
    pose_video: PathText = Field("", description="Animate: the driving pose video (its length is the output's)")
    face_video: PathText = Field("", description="Animate: the driving face crops, frame-aligned with the pose")
    background_video: PathText = Field("", description="Animate replace mode: the scene the character goes into")
    mask_video: PathText = Field("", description="VACE: mask video, white = generate (red channel, greys kept); Animate "
                                 "replace mode: the character's mask (white = character)")
    # Wan2.2-Animate-2: the reference_image's character moving as the driving video (as long as it)
    driving_video: PathText = Field("", description="Animate-2: the driving video (its length is the output's)")
    reference_prompt: str = Field("", description="Animate-2: the prompt of the driving video's reference pass; empty: "
                                  "the release's own (人物动作的参考视频)")
    animate_mode: Literal["animate", "replace"] = "animate"
    continuation_frames: Literal[1, 5] = Field(1, description="Animate, Animate-2: frames of the "
                                               "previous segment that condition the next one")

    @field_validator("scheduler", mode="before")
    @classmethod
    def _upper_scheduler(cls, value):
        return value.upper() if isinstance(value, str) else value

    def with_defaults(self, **defaults) -> "SampleConfig":
        """A copy in which every field this sample did not set explicitly takes the value in `defaults` (None values
        in `defaults` are skipped). Fields set explicitly always win."""
        unknown = set(defaults) - set(type(self).model_fields)
        if unknown:
            raise ValueError(f"unknown sample fields: {sorted(unknown)}")
        values = {k: v for k, v in defaults.items() if v is not None and k not in self.model_fields_set}
        return SampleConfig(**{**values, **self.model_dump(exclude_unset=True)})

    @property
    def effective_negative_prompt(self) -> str:
        return self.negative_prompt if self.negative_prompt.strip() else WAN_DEFAULT_NEGATIVE_PROMPT
