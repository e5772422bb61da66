"""Numbers behind the GUI's plots, computed by the project's own code (no toolkit here)."""
from __future__ import annotations

import math

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


# --- the loss tab's graph (modules/ui/CtkLossView.py) -------------------------------------------------------------

LOSS_SCALE = ("loss", "smoothed", "validation")   # the curves drawn on the left axis; the learning rate has its own
MARGINS = (60, 12, 72, 46)   # left, top, right (the lr labels), bottom (the step ticks and their label)


def plot_area(width: int, height: int) -> tuple[int, int, int, int]:
    """(left, top, right, bottom) of the plot inside a canvas of `width` x `height` pixels: the graph takes the
    space the tab gives it (an end-of-run panel under the bar makes it shorter, never hides its lower part)."""
    left, top, right, bottom = MARGINS
    return left, top, max(left + 100, width - right), max(top + 60, height - bottom)


def loss_axis(curves: dict[str, list[tuple[int, float]]]) -> tuple[float, float] | None:
    """The left axis' range: every finite value of every loss-scale curve drawn (a validation point far above the
    training loss widens it as it is added); None when there is none. A NaN or inf value is left out (drawn, it
    would have no place on any axis)."""
    values = [v for name in LOSS_SCALE for _, v in curves.get(name, []) if math.isfinite(v)]
    if not values:
        return None
    low, high = min(values), max(values)
    return (low, high) if high > low else (low - 0.5 * (abs(low) or 1.0), high + 0.5 * (abs(high) or 1.0))


def y_of(value: float, axis: tuple[float, float], top: float, bottom: float) -> float:
    """The canvas y of `value` on `axis` (high at the top)."""
    low, high = axis
    return bottom - (bottom - top) * (value - low) / (high - low)


def stack_check_axis(points: list[tuple[int, float]]) -> tuple[float, float]:
    """The stack check's own scale (a distance, docs/distilled.md): from 0, so a climb reads as one, to a little above
    its highest finite value."""
    values = [v for _, v in points if math.isfinite(v)]
    return 0.0, max(values, default=0.0) * 1.1 or 1.0
