from enum import Enum

import torch


class DataType(str, Enum):
    FLOAT_32 = "FLOAT_32"
    FLOAT_16 = "FLOAT_16"
    BFLOAT_16 = "BFLOAT_16"

    def __str__(self) -> str:
        return self.value

    def torch_dtype(self) -> torch.dtype:
        return {"FLOAT_32": torch.float32, "FLOAT_16": torch.float16, "BFLOAT_16": torch.bfloat16}[self.value]
