"""One LoRA adapter of a linear or Conv3d layer: `down`, `up`, `alpha` and DoRA's optional magnitude (see
modules/util/lora/formats.py for the file layouts). Its own module so that the per-model key rewrites (the face
adapter's fused key/value) and the format reader use it without importing each other."""
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class LoraModule:
    down: Tensor  # lora_A: (rank, in) or (rank, in, *kernel)
    up: Tensor  # lora_B: (out, rank) or (out, rank, 1, 1, 1)
    alpha: float
    dora_scale: Tensor | None = None  # (out, 1) or (1, in), see the module docstring

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self, strength: float = 1.0, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        """`up @ down * alpha / rank * strength`, shaped like the adapted weight: (out, in) or (out, in, *kernel)."""
        up = self.up.to(device=device, dtype=dtype).flatten(1)
        down = self.down.to(device=device, dtype=dtype).flatten(1)
        return (up @ down * (self.scale * strength)).reshape(self.up.shape[0], *self.down.shape[1:])

    def cast_factors(self, dtype: torch.dtype) -> None:
        """down and up to `dtype` in place (dora_scale as it is)."""
        self.down, self.up = self.down.to(dtype), self.up.to(dtype)
