from typing import Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.DataConfig import DataConfig
from modules.util.config.DistributedConfig import DistributedConfig
from modules.util.config.E2VTrainConfig import E2VTrainConfig
from modules.util.config.MethodConfig import EmbeddingConfig, FineTuneConfig, LoraConfig
from modules.util.config.ModelConfig import ModelConfig, OutputConfig
from modules.util.config.OptimizerConfig import OptimizerConfig, TimestepConfig
from modules.util.config.PerformanceConfig import PerformanceConfig
from modules.util.config.SchedulingConfig import BackupConfig, SamplingConfig
from modules.util.enum.DataType import DataType
from modules.util.enum.ModelType import ModelType
from modules.util.enum.TrainingMethod import TrainingMethod


class TrainConfig(BaseConfig):
    """The whole training configuration. Saved as JSON with a `__version` key (see config_io)."""

    model_type: ModelType = ModelType.WAN_2_1
    training_method: TrainingMethod = TrainingMethod.LORA
    model: ModelConfig = ModelConfig()
    output: OutputConfig = OutputConfig()
    workspace_dir: str = Field("workspace/run", description="backups (shared by its runs, so a resume finds the "
                               "newest), and per run the TensorBoard log and previews")
    run_name: str = Field("", description="names this run's TensorBoard and samples folders in the workspace; empty: "
                          "the start time (a resume continues the name of the run it resumes). The trainer fills "
                          "it in when empty: set it back to '' to reuse the config object for a new run")
    cache_dir: str = "workspace/cache"
    tensorboard: bool = True
    demo_assets: bool = Field(False, description="create the tiny demo model and dataset at the configured "
                                                       "paths when they are missing")

    seed: int = 42
    device: str = Field("auto", description="auto, cpu, cuda, cuda:N")
    train_dtype: DataType = DataType.BFLOAT_16
    gradient_checkpointing: bool = Field(True, description="recompute block activations in the backward pass; "
                                         "performance.checkpoint_every sets how many blocks")
    epochs: int = Field(10, ge=1)
    max_steps: int = Field(0, ge=0, description="stop after this many optimizer steps; 0: run all epochs")
    batch_size: int = Field(1, ge=1)
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
    backup: BackupConfig = BackupConfig()
    e2v: E2VTrainConfig = E2VTrainConfig()
    performance: PerformanceConfig = PerformanceConfig()
    distributed: DistributedConfig = DistributedConfig()
