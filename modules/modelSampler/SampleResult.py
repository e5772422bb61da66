"""What a sampler returns, and the error it raises for a sample it cannot make. Its own module so that the samplers of
each model family (WanModelSampler, WanAnimateSampler, ...) share them without importing each other."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from modules.util.config.SampleConfig import SampleConfig


class SampleError(ValueError):
    """A sample that cannot be generated as asked (missing image, image given to a text-only model, ...)."""


@dataclass
class SampleResult:
    frames: np.ndarray            # (F, H, W, 3) float32 in [0, 1], as diffusers' pipelines return with "np"
    fps: int
    sample: SampleConfig          # the settings actually used (rounded sizes, the flow shift in effect, ...)
    notes: list[str] = field(default_factory=list)
    latents: torch.Tensor | None = None  # (C, T, h, w) normalised, as the denoising loop ended (before decoding)
    accelerator: dict | None = None      # what accelerated it (Accelerator.record()), None when not accelerated

    def frames_uint8(self) -> np.ndarray:
        return (self.frames * 255.0).round().clip(0, 255).astype(np.uint8)
