"""The stack check (`distill.mode` "base" with `sampling.accelerator`, docs/distilled.md): at each preview, how far
the accelerated sample of base + the LoRA being trained departs from the same sample (same seed, so the same initial
noise) made at its own full steps and guidance without the accelerator.

The distance is relative, over the final normalised latents (C, T, h, w) the two denoising loops end with:

    distance = rms(accelerated - full) / rms(full)

Latents, not pixels: they are what the two loops compute, before the VAE decode and the clipping to [0, 1] that hide
differences. Relative: divided by the full-step sample's own size, so it reads the same for every model, size and
sample (0: identical; about 1.4 (the square root of 2): as unlike as two unrelated samples of the same size). A
distance that climbs over the run says that stacking the LoRA on the accelerator drifts from what the LoRA does on
the base.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

FULL_STEPS_SUFFIX = "-full"   # the full-step sample's file name suffix (<step>-<epoch>-full.mp4) and result key


def stack_distance(accelerated: torch.Tensor, full: torch.Tensor) -> float:
    """rms(accelerated - full) / rms(full) of two latents of one shape (C, T, h, w), in float64."""
    if accelerated.shape != full.shape:
        raise ValueError(f"stack check: latents of shapes {tuple(accelerated.shape)} and {tuple(full.shape)}")
    accelerated, full = accelerated.double(), full.double()
    scale = full.square().mean().sqrt()
    if scale == 0:
        raise ValueError("stack check: the full-step sample's latents are all zero")
    return float((accelerated - full).square().mean().sqrt() / scale)


@dataclass
class StackCheck:
    step: int
    sample: str             # the preview's folder name, <index>-<prompt slug>
    distance: float
    full_steps: int         # the full-step sample's own steps and guidance
    full_guidance: float

    def record(self) -> dict:
        """The preview JSON's `stack_check` entry."""
        return {"distance": self.distance, "full_steps": self.full_steps, "full_guidance": self.full_guidance}


def report_lines(checks: list[StackCheck]) -> list[str]:
    """The run report's lines: each sample's distances in step order."""
    if not checks:
        return []
    lines = ["  stack check (accelerated vs full-step preview, relative latent distance; 0: identical):"]
    for sample in dict.fromkeys(check.sample for check in checks):
        values = [f"step {c.step} {c.distance:.4f}" for c in checks if c.sample == sample]
        lines.append(f"    {sample}: {', '.join(values)}")
    return lines
