from typing import Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig


class DistributedConfig(BaseConfig):
    """Several processes (docs/multi-gpu.md). They apply under torchrun and with `multi_gpu: true`."""

    processes: int = Field(0, ge=0, description="multi_gpu: processes to launch; 0: one per visible GPU")
    timeout_minutes: float = Field(30.0, gt=0, description="a collective waiting longer than this stops the job "
                                                           "(rank 0 sampling previews must finish within it)")
    reduce_dtype: Literal["FLOAT_32", "BFLOAT_16"] = Field(
        "FLOAT_32", description="the dtype in which ranks average gradients (BFLOAT_16 halves the traffic)")
