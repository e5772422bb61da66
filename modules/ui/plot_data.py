"""Numbers behind the GUI's plots, computed by the project's own code (no toolkit here)."""
from __future__ import annotations

import torch

from modules.util.config.OptimizerConfig import TimestepConfig


def timestep_density(config: TimestepConfig, bins: int = 40, draws: int = 20000, seed: int = 0,
                     expert: str = "both", boundary: float | None = None) -> list[float]:
    """The density of training sigmas over [0, 1] in `bins` bins, from `sample_sigmas` itself (what training
    draws). A14B `expert` 'high' / 'low' restricts to its side of `boundary` as the setup does."""
    from modules.modelSetup.timestep_sampling import sample_sigmas

    generator = torch.Generator().manual_seed(seed)
    low, high, include_high = 0.0, 1.0, True
    if boundary is not None and expert == "high":
        low = boundary
    elif boundary is not None and expert == "low":
        high, include_high = boundary, False
    sigmas = sample_sigmas(config, draws, generator, low, high, include_high)
    counts = torch.histc(sigmas, bins=bins, min=0.0, max=1.0)
    return (counts / counts.sum() * bins).tolist()
