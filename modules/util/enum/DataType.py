from enum import Enum

import torch


class DataType(str, Enum):
    FLOAT_32 = "FLOAT_32"
    FLOAT_16 = "FLOAT_16"
    BFLOAT_16 = "BFLOAT_16"
    # stored as float8_e4m3fn, computed in bfloat16 (diffusers' layerwise casting); base weights only
    FLOAT_8 = "FLOAT_8"
    # bitsandbytes-quantised frozen transformer weights (CUDA only), computed in bfloat16
    NF4 = "NF4"
    INT8 = "INT8"

    def __str__(self) -> str:
        return self.value

    def torch_dtype(self) -> torch.dtype:
        """The dtype computations run in (FLOAT_8 weights compute in bfloat16)."""
        return {"FLOAT_32": torch.float32, "FLOAT_16": torch.float16, "BFLOAT_16": torch.bfloat16,
                "FLOAT_8": torch.bfloat16, "NF4": torch.bfloat16, "INT8": torch.bfloat16}[self.value]

    @property
    def is_quantized(self) -> bool:
        """bitsandbytes weights: GPU only, frozen base weights of a transformer only."""
        return self in (DataType.NF4, DataType.INT8)

    def storage_dtype(self) -> torch.dtype:
        """The dtype weights are written in (FLOAT_8: float8_e4m3fn, the fp8 ComfyUI loads)."""
        return torch.float8_e4m3fn if self is DataType.FLOAT_8 else self.torch_dtype()
