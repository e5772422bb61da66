from typing import Literal

from pydantic import Field

from modules.util.config.BaseConfig import BaseConfig
from modules.util.config.bounds import MAX_TIMEOUT_MINUTES, MIN_TIMEOUT_MINUTES


class DistributedConfig(BaseConfig):
    """Several processes (docs/multi-gpu.md). They apply under torchrun and with `multi_gpu: true`."""

    processes: int = Field(0, ge=0, le=4096, description="multi_gpu: processes to launch; 0: one per visible GPU")
    timeout_minutes: float = Field(30.0, ge=MIN_TIMEOUT_MINUTES, le=MAX_TIMEOUT_MINUTES,
                                   description="a collective waiting longer than this stops the job (rank 0 sampling "
                                               f"previews must finish within it); {MIN_TIMEOUT_MINUTES:g} to "
                                               f"{MAX_TIMEOUT_MINUTES:g} (a week)")
    reduce_dtype: Literal["FLOAT_32", "BFLOAT_16"] = Field(
        "FLOAT_32", description="the dtype in which ranks average gradients (BFLOAT_16 halves the traffic)")
    shard_base: bool | Literal["auto"] = Field(
        "auto", description="adapters: split the frozen base over the GPUs (FSDP2) instead of a whole copy on each; "
                            "auto: when the whole base does not fit one GPU's free memory")
    cpu_offload: bool = Field(False, description="sharded runs: keep each GPU's shard of the weights (and of the "
                                                 "gradients and optimizer state) in host memory, gathered block by "
                                                 "block (FSDP2's CPU offload, the multi-GPU block swap)")
    context_parallel: int = Field(1, ge=1, le=64, description="split each clip's tokens over this many GPUs (Ulysses "
                                                             "attention: all-to-all over the heads); the processes "
                                                             "form data-parallel groups of this size")
    expert_parallel: bool = Field(True, description="Wan 2.2 A14B with expert: both (LoRA) on an even number of "
                                                    "processes: the high-noise expert on the first half, the "
                                                    "low-noise expert on the second, both trained in every step "
                                                    "(each GPU holds one expert; false: DDP, every GPU holds both "
                                                    "and each step trains one)")
