import re
from typing import Literal

from pydantic import Field, field_validator

from modules.util.config.AnimateConfig import AnimateConfig
from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import FolderName, Seed, WritePath
from modules.util.config.DataConfig import DataConfig
from modules.util.config.DistillConfig import DistillConfig
from modules.util.config.DistributedConfig import DistributedConfig
from modules.util.config.E2VTrainConfig import E2VTrainConfig
from modules.util.config.MethodConfig import EmbeddingConfig, FineTuneConfig, LoraConfig
from modules.util.config.ModelConfig import ModelConfig, OutputConfig
from modules.util.config.OptimizerConfig import OptimizerConfig, TimestepConfig
from modules.util.config.PerformanceConfig import PerformanceConfig
from modules.util.config.RemoteConfig import RemoteConfig
from modules.util.config.SchedulingConfig import BackupConfig, SamplingConfig
from modules.util.config.LossConfig import LossConfig
from modules.util.config.ValidationConfig import ValidationConfig
from modules.util.enum.DataType import DataType
from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod

DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:[0-9]{1,3})?")


class TrainConfig(BaseConfig):
    """The whole training configuration. Saved as JSON with a `__version` key (see config_io)."""

    model_type: ModelType = ModelType.WAN_2_1
    training_method: TrainingMethod = TrainingMethod.LORA
    model: ModelConfig = ModelConfig()
    output: OutputConfig = OutputConfig()
    workspace_dir: WritePath = Field("workspace/run", description="backups (shared by its runs, so a resume finds the "
                               "newest), and per run the TensorBoard log and previews")
    run_name: FolderName = Field("", description="names this run's TensorBoard and samples folders in the workspace; empty: "
                          "the start time (a resume continues the name of the run it resumes). The trainer fills "
                          "it in when empty: set it back to '' to reuse the config object for a new run")
    cache_dir: WritePath = "workspace/cache"
    tensorboard: bool = True
    demo_assets: bool = Field(False, description="create the tiny demo model and dataset at the configured "
                                                       "paths when they are missing")

    seed: Seed = 42
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N, mps; checked against this machine's devices "
                                            "before the model loads")
    train_dtype: DataType = Field(DataType.BFLOAT_16, description="the compute type: FLOAT_32, BFLOAT_16 or FLOAT_16")
    gradient_checkpointing: bool = Field(True, description="recompute block activations in the backward pass; "
                                         "performance.checkpoint_every sets how many blocks")
    epochs: int = Field(10, ge=1, le=1_000_000)
    max_steps: int = Field(0, ge=0, le=10 ** 12, description="stop after this many optimizer steps; 0: run all epochs")
    batch_size: int = Field(1, ge=1, le=4096)
    multi_gpu: bool = Field(False, description="re-launch through torchrun on every visible GPU (batch_size is "
                                               "per GPU; docs/multi-gpu.md)")
    expert: Literal["high", "low", "both"] = Field("both", description="Wan 2.2 A14B: which expert(s) train")

    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    timestep: TimestepConfig = TimestepConfig()
    lora: LoraConfig = LoraConfig()
    fine_tune: FineTuneConfig = FineTuneConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()
    sampling: SamplingConfig = SamplingConfig()
    distill: DistillConfig = DistillConfig()
    backup: BackupConfig = BackupConfig()
    validation: ValidationConfig = ValidationConfig()
    loss: LossConfig = LossConfig()
    e2v: E2VTrainConfig = E2VTrainConfig()
    animate: AnimateConfig = AnimateConfig()
    performance: PerformanceConfig = PerformanceConfig()
    distributed: DistributedConfig = DistributedConfig()
    remote: RemoteConfig = RemoteConfig()

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        # the spelling only; whether this machine has the device is checked in validation.device_problems
        if not DEVICE_PATTERN.fullmatch(value):
            from modules.util.devices import available_devices
            raise ValueError(f"a device is auto, cpu, cuda, cuda:N or mps; devices here: "
                             f"{', '.join(available_devices())}")
        return value

    @field_validator("train_dtype")
    @classmethod
    def _compute_dtype(cls, value: DataType) -> DataType:
        if value == DataType.FLOAT_8 or value.is_quantized:
            raise ValueError(f"{value} is a storage type for base weights (model.<part>.weight_dtype), not a compute "
                             f"type; train_dtype is FLOAT_32, BFLOAT_16 or FLOAT_16")
        return value
