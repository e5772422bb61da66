from typing import Annotated

from pydantic import Field, field_validator

from modules.util.config.AcceleratorConfig import AcceleratorConfig
from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import MAX_LIST, MAX_LORA_STRENGTH, PathText
from modules.util.config.SampleConfig import SamplerScheduler


class SamplingConfig(BaseConfig):
    samples_file: PathText = Field("", description="a samples JSON file or a musubi-style prompt file")
    every_n_steps: int = Field(0, ge=0)
    every_n_epochs: int = Field(0, ge=0)
    every_n_minutes: float = Field(0.0, ge=0)
    sample_before_training: bool = False
    skip_first: int = Field(0, ge=0)
    steps: int | None = Field(None, ge=1, le=1000, description="empty: the model's default (20; the official "
                              "sample steps for a base read from an official release or ComfyUI files)")
    guidance: float | None = Field(None, ge=0, description="empty: the model's default (5; the official guidance "
                                   "of each expert for a base read from an official release or ComfyUI files)")
    scheduler: SamplerScheduler = "UNIPC"
    compare_strengths: list[Annotated[float, Field(ge=-MAX_LORA_STRENGTH, le=MAX_LORA_STRENGTH)]] = Field(
        [], max_length=MAX_LIST, description="LoRA: each preview is also made at these strengths of the LoRA being "
        "trained (<step>-<epoch>-x<strength>.mp4 beside it; docs/compare.md)")
    accelerator: AcceleratorConfig = Field(AcceleratorConfig(), description="previews run with this step-distill "
                                           "LoRA on its own schedule, guidance 1 (docs/distilled.md)")

    @field_validator("scheduler", mode="before")
    @classmethod
    def _upper_scheduler(cls, value):
        return value.upper() if isinstance(value, str) else value


class BackupConfig(BaseConfig):
    every_n_steps: int = Field(0, ge=0)
    every_n_epochs: int = Field(0, ge=0)
    every_n_minutes: float = Field(0.0, ge=0)
    rolling_count: int = Field(3, ge=1, le=10_000)
    backup_before_save: bool = Field(True, description="write a backup before the final save, so a failed save "
                                                       "(a full disk) loses nothing")
    continue_last_backup: bool = False
    save_every_n_steps: int = Field(0, ge=0)
    save_every_n_epochs: int = Field(0, ge=0)
    save_rolling_count: int = Field(0, ge=0, le=10_000, description="intermediate saves (workspace/save) to keep, newest "
                                                         "first; 0: keep all")
