from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig


class SamplingConfig(BaseConfig):
    samples_file: str = Field("", description="a samples JSON file or a musubi-style prompt file")
    every_n_steps: int = Field(0, ge=0)
    every_n_epochs: int = Field(0, ge=0)
    every_n_minutes: float = Field(0.0, ge=0)
    sample_before_training: bool = False
    skip_first: int = Field(0, ge=0)
    steps: int = Field(20, ge=1)
    guidance: float = Field(5.0, ge=0)
    scheduler: str = "UNIPC"


class BackupConfig(BaseConfig):
    every_n_steps: int = Field(0, ge=0)
    every_n_epochs: int = Field(0, ge=0)
    every_n_minutes: float = Field(0.0, ge=0)
    rolling_count: int = Field(3, ge=1)
    backup_before_save: bool = Field(True, description="write a backup before the final save, so a failed save "
                                                       "(a full disk) loses nothing")
    continue_last_backup: bool = False
    save_every_n_steps: int = Field(0, ge=0)
    save_every_n_epochs: int = Field(0, ge=0)
    save_rolling_count: int = Field(0, ge=0, description="intermediate saves (workspace/save) to keep, newest "
                                                         "first; 0: keep all")
