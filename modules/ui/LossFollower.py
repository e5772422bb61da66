"""The loss tab's data, followed off the UI thread. Imports no toolkit.

A worker thread reads the followed run's newly appended TensorBoard events (LossHistory.RunEvents) about every
second, or the window's own per-step losses when the run logs no events, and publishes a snapshot: the curves and,
for the whole step range, their decimated lines (at most two points per pixel column). The view only draws a
snapshot, and only while its tab is shown: a run of 20,000 steps costs the Tk main loop a drawing of a few thousand
points, never a reading of the history.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from modules.ui import LossHistory as history

COLUMNS = 1060   # the plot's width in pixels (CtkLossView's frame)


@dataclass
class LossSnapshot:
    run: history.RunCurves
    overview: dict[str, history.Points] = field(default_factory=dict)   # the curves decimated for the whole range


@dataclass(frozen=True)
class Source:
    folder: Path                                       # <workspace>/tensorboard/<run>
    losses: Callable[[], list[float]] | None = None    # the window's own losses, used while the folder has no events
    first_step: int = 1


class LossFollower:
    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self.snapshot: LossSnapshot | None = None
        self.version = 0                     # raised with every new snapshot
        self.error = ""
        self._source: Source | None = None
        self._events: history.RunEvents | None = None
        self._losses_seen = -1
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    @property
    def source(self) -> Source | None:
        return self._source

    def follow(self, source: Source) -> None:
        """Follows another run (read from its start), or reads the same one again now."""
        with self._lock:
            if source != self._source:
                self._source, self._events, self._losses_seen = source, None, -1
        self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="loss-follower", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()

    def read_now(self) -> bool:
        """One reading of the followed run (the worker's step; tests call it directly); True when a new snapshot
        was published."""
        with self._lock:
            source = self._source
            if source is None:
                return False
            if self._events is None or self._events.folder != source.folder:
                self._events = history.RunEvents(source.folder)
            events = self._events
        if source.folder.is_dir() and events.read():
            run = events.curves()
        elif events.has_points:
            return False
        elif source.losses is not None:
            losses = list(source.losses())
            if len(losses) == self._losses_seen:
                return False
            self._losses_seen = len(losses)
            run = history.from_losses(source.folder.name, losses, source.first_step)
        elif self.snapshot is None or self.snapshot.run.name != source.folder.name:
            run = events.curves()   # nothing logged yet: an empty run of the new name
        else:
            return False
        snapshot = LossSnapshot(run, {name: history.decimate(points, COLUMNS) for name, points in run.curves.items()})
        with self._lock:
            if source != self._source:   # retargeted meanwhile: this one is stale
                return False
            self.snapshot = snapshot
            self.version += 1
        return True

    def _loop(self) -> None:
        while not self._stopped:
            try:
                self.read_now()
                self.error = ""
            except OSError as error:   # a folder removed or unreadable meanwhile: said on the tab, tried again
                self.error = f"cannot read the run's events: {error}"
            self._wake.wait(self.interval)
            self._wake.clear()
