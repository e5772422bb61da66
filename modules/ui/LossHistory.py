"""The loss graph's numbers: a run's training loss, learning rate and validation loss, read from its TensorBoard
event files (tensorboard's EventAccumulator), so runs started from the command line show as well as the window's.
Imports no toolkit.

A workspace's runs log to <workspace>/tensorboard/<run>/; a resumed run continues its folder (its steps after the
backup are logged again when the killed run had gone further: the last value logged for a step wins).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

TAGS = {"loss": "loss/step", "smoothed": "loss/smoothed", "lr": "lr/group_0", "validation": "validation/loss"}

Points = list[tuple[int, float]]


@dataclass
class RunCurves:
    name: str
    curves: dict[str, Points] = field(default_factory=dict)   # "loss", "smoothed", "lr", "validation"

    def steps(self) -> tuple[int, int]:
        every = [step for points in self.curves.values() for step, _ in points]
        return (min(every), max(every)) if every else (0, 0)


def run_folders(workspace: str | Path) -> list[Path]:
    """The workspace's runs with TensorBoard events, oldest first (run names start with their start time)."""
    root = Path(workspace) / "tensorboard"
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and any(d.glob("events.out.tfevents.*")))


def read_run(folder: str | Path) -> RunCurves:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    # its directory watcher logs "No path found after <file>" at INFO on every read: noise in the window's log panel
    logging.getLogger("tensorboard").setLevel(logging.WARNING)
    accumulator = EventAccumulator(str(folder), size_guidance={SCALARS: 0})   # 0: every point, not a sample
    accumulator.Reload()
    available = set(accumulator.Tags().get("scalars", []))
    run = RunCurves(Path(folder).name)
    for name, tag in TAGS.items():
        if tag in available:
            # the value logged last for a step wins, by its time: the accumulator reads a folder's event files in
            # name order, and two writers opened in one second are named by a counter ('.10' before '.9')
            latest: dict[int, tuple[float, float]] = {}
            for event in accumulator.Scalars(tag):
                if event.step not in latest or event.wall_time >= latest[event.step][0]:
                    latest[event.step] = (event.wall_time, float(event.value))
            run.curves[name] = sorted((step, value) for step, (_, value) in latest.items())
    return run


def from_losses(name: str, losses: list[float], first_step: int = 1, smoothing: float = 0.9) -> RunCurves:
    """The window's own run when it logs no TensorBoard events (tensorboard off): its per-step losses."""
    points = [(first_step + i, value) for i, value in enumerate(losses)]
    return RunCurves(name, {"loss": points, "smoothed": smoothed(points, smoothing)})


def smoothed(points: Points, weight: float = 0.9) -> Points:
    """An exponential moving average, as TensorBoard's smoothing slider draws it (debiased at the start)."""
    out, average = [], 0.0
    for index, (step, value) in enumerate(points):
        average = weight * average + (1 - weight) * value
        out.append((step, average / (1 - weight ** (index + 1))))
    return out


def in_range(points: Points, first: int | None, last: int | None) -> Points:
    return [(s, v) for s, v in points if (first is None or s >= first) and (last is None or s <= last)]


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round axis ticks (1, 2, 5 x 10^k apart) covering [low, high]."""
    import math
    if high <= low:
        return [low]
    raw = (high - low) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]
