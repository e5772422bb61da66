"""The loss graph's numbers: a run's training loss, learning rate and validation loss, read from its TensorBoard
event files, so runs started from the command line show as well as the window's. Imports no toolkit.

A workspace's runs log to <workspace>/tensorboard/<run>/; a resumed run continues its folder (its steps after the
backup are logged again when the killed run had gone further: the last value logged for a step wins).

`RunEvents` reads a folder incrementally: each `read()` parses only the records appended since the last one
(tensorboard's own event file loader keeps each file's offset), so following a run of 20,000 steps costs what its
last few steps wrote, not the whole history. The smoothed line is computed here from the merged losses, not read
from the trainer's `loss/smoothed` tag: the trainer's average starts afresh when a run resumes, and the line must
run on through a resume point.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

TAGS = {"loss/step": "loss", "lr/group_0": "lr", "validation/loss": "validation"}
# the previews' stack check (docs/distilled.md): one tag per sample, `stack_check/<index>-<prompt>`; the graph draws
# their mean at each preview step
STACK_CHECK_PREFIX = "stack_check/"
STACK_CHECK = "stack check"
SMOOTHING = 0.95   # the trainer's own (TrainingHooks): an uninterrupted run's line equals its loss/smoothed tag

Points = list[tuple[int, float]]


@dataclass
class RunCurves:
    name: str
    curves: dict[str, Points] = field(default_factory=dict)   # "loss", "smoothed", "lr", "validation", STACK_CHECK

    def steps(self) -> tuple[int, int]:
        every = [step for points in self.curves.values() for step, _ in points]
        return (min(every), max(every)) if every else (0, 0)


def run_folders(workspace: str | Path) -> list[Path]:
    """The workspace's runs with TensorBoard events, oldest first (run names start with their start time)."""
    root = Path(workspace) / "tensorboard"
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir() if d.is_dir() and any(d.glob("events.out.tfevents.*")))


class RunEvents:
    """One run folder's scalars, read incrementally (see the module doc)."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._loaders: dict[Path, object] = {}
        # curve -> step -> (wall time, value): the value logged last for a step wins, by its time. A folder's event
        # files are read in name order, and two writers opened in one second are named by a counter ('.10' before
        # '.9'), so the order of reading cannot decide
        self._latest: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in TAGS.values()}
        self._stack_checks: dict[str, dict[int, tuple[float, float]]] = {}   # tag -> step -> (wall time, value)
        self.records_read = 0   # events parsed so far, over every reading

    def read(self) -> bool:
        """Reads what was appended to the folder's event files since the last call; True when a point changed."""
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
        from tensorboard.compat import tf

        # its directory watcher logs "No path found after <file>" at INFO on every read: noise in the log panel
        logging.getLogger("tensorboard").setLevel(logging.WARNING)
        changed = False
        for path in sorted(self.folder.glob("events.out.tfevents.*")):
            loader = self._loaders.get(path)
            if loader is None:
                try:
                    loader = self._loaders[path] = LegacyEventFileLoader(str(path))
                except tf.errors.NotFoundError:   # removed since the folder was listed
                    continue
            for event in loader.Load():
                self.records_read += 1
                for value in event.summary.value:
                    if value.tag.startswith(STACK_CHECK_PREFIX):
                        latest = self._stack_checks.setdefault(value.tag, {})
                    elif value.tag in TAGS:
                        latest = self._latest[TAGS[value.tag]]
                    else:
                        continue
                    number = value.simple_value if value.HasField("simple_value") else \
                        (value.tensor.float_val[0] if value.tensor.float_val else math.nan)
                    known = latest.get(event.step)
                    if known is None or event.wall_time >= known[0]:
                        latest[event.step] = (event.wall_time, float(number))
                        changed = True
        return changed

    @property
    def has_points(self) -> bool:
        return any(self._latest.values()) or any(self._stack_checks.values())

    def curves(self) -> RunCurves:
        run = RunCurves(self.folder.name)
        for name, latest in self._latest.items():
            if latest:
                run.curves[name] = sorted((step, value) for step, (_, value) in latest.items())
        if "loss" in run.curves:
            run.curves["smoothed"] = smoothed(run.curves["loss"])
        by_step: dict[int, list[float]] = {}
        for latest in self._stack_checks.values():
            for step, (_, value) in latest.items():
                by_step.setdefault(step, []).append(value)
        if by_step:
            run.curves[STACK_CHECK] = [(step, sum(values) / len(values)) for step, values in sorted(by_step.items())]
        return run


def read_run(folder: str | Path) -> RunCurves:
    events = RunEvents(folder)
    events.read()
    return events.curves()


def from_losses(name: str, losses: list[float], first_step: int = 1) -> RunCurves:
    """The window's own run when it logs no TensorBoard events (tensorboard off): its per-step losses."""
    points = [(first_step + i, value) for i, value in enumerate(losses)]
    return RunCurves(name, {"loss": points, "smoothed": smoothed(points)})


def smoothed(points: Points, weight: float = SMOOTHING) -> Points:
    """An exponential moving average over the points in step order, started at the first value, as the trainer's
    loss/smoothed (TrainingHooks) is: over a resumed run's merged losses it runs on through the resume point."""
    out, average = [], None
    for step, value in points:
        average = value if average is None else weight * average + (1 - weight) * value
        out.append((step, average))
    return out


def in_range(points: Points, first: int | None, last: int | None) -> Points:
    return [(s, v) for s, v in points if (first is None or s >= first) and (last is None or s <= last)]


def decimate(points: Points, columns: int) -> Points:
    """At most two points per pixel column (its lowest and highest, in step order): the line drawn from them looks
    as the whole curve's would (spikes kept), for 20,000 steps as for 200, at a hundredth of the drawing cost."""
    if len(points) <= 2 * columns:
        return points
    low, high = points[0][0], points[-1][0]
    width = (high - low + 1) / columns
    out: Points = []
    column, lowest, highest = None, None, None
    for point in points:
        here = int((point[0] - low) / width)
        if here != column:
            if column is not None:
                out.extend(sorted({lowest, highest}))
            column, lowest, highest = here, point, point
        else:
            if point[1] < lowest[1]:
                lowest = point
            if point[1] > highest[1]:
                highest = point
    out.extend(sorted({lowest, highest}))
    return out


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round axis ticks (1, 2, 5 x 10^k apart) covering [low, high]."""
    if high <= low:
        return [low]
    raw = (high - low) / max(1, count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step) + 1)]
