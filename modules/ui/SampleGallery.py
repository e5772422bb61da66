"""The sample gallery's grid: every preview of a workspace's runs, rows = samples (prompt folders), columns = the
training steps at which previews were made, in step order (10 after 9, not after 1). Imports no toolkit.

A run's previews are <workspace>/samples/<run>/<index>-<slug>/<step>-<epoch>.mp4, each with the settings it was made
with in <step>-<epoch>.json (prompt, seed, size; previews from before that file existed show the folder's slug).
Comparison grids of the checkpoint x strength tool are the MP4s under <workspace>/compare/ (the tools tab's default
output folder) with the tool's layout file beside them (<stem>.json).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from modules.ui.SamplingController import PREVIEW_NAME, epoch_text, run_label


@dataclass
class GalleryCell:
    path: Path
    step: int
    epoch: int
    prompt: str
    seed: int | None
    label: str = ""   # how it ran, where that differs from the sample's settings ("4 steps, accelerated")

    @property
    def tooltip(self) -> str:
        seed = "random" if self.seed is None or self.seed < 0 else str(self.seed)
        label = f"\n{self.label}" if self.label else ""
        return f"step {self.step} ({epoch_text(self.step, self.epoch)}){label}\nseed {seed}\n{self.prompt}"


@dataclass
class GalleryRun:
    name: str
    folder: Path
    rows: list[str] = field(default_factory=list)                 # prompt folder names, by sample index
    steps: list[int] = field(default_factory=list)                # ascending
    cells: dict[tuple[str, int], GalleryCell] = field(default_factory=dict)   # (row, step) -> cell


def _index(folder: Path) -> int:
    head = folder.name.split("-", 1)[0]
    return int(head) if head.isdigit() else 1 << 30


def read_run(folder: Path, known: GalleryRun | None = None) -> GalleryRun:
    """A run's previews; `known`: this run as read before, whose cells are kept (their settings files are not read
    again: following a run of a thousand previews reads only the new ones)."""
    run = GalleryRun(folder.name, folder)
    cells_before = {cell.path: cell for cell in known.cells.values()} if known is not None else {}
    steps = set()
    for prompt_folder in sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: (_index(p), p.name)):
        found = False
        for video in prompt_folder.glob("*.mp4"):
            match = PREVIEW_NAME.match(video.name)
            if not match:
                continue
            if video in cells_before:
                cell = cells_before[video]
                run.cells[(prompt_folder.name, cell.step)] = cell
                steps.add(cell.step)
                found = True
                continue
            step, epoch = int(match[1]), int(match[2])
            settings = {}
            sidecar = video.with_suffix(".json")
            if sidecar.is_file():
                try:
                    settings = json.loads(sidecar.read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    settings = {}
            slug = prompt_folder.name.split("-", 1)[-1].replace("_", " ")
            run.cells[(prompt_folder.name, step)] = GalleryCell(video, step, epoch, settings.get("prompt", slug),
                                                                settings.get("seed"), run_label(settings))
            steps.add(step)
            found = True
        if found:
            run.rows.append(prompt_folder.name)
    run.steps = sorted(steps)
    return run


def gallery_runs(workspace: str | Path) -> list[GalleryRun]:
    """Every run with previews, newest first (run folders are named by their start time)."""
    root = Path(workspace) / "samples"
    if not root.is_dir():
        return []
    runs = [read_run(folder) for folder in sorted(root.iterdir(), reverse=True) if folder.is_dir()]
    return [run for run in runs if run.rows]


def comparison_grids(workspace: str | Path) -> list[Path]:
    """The compare tool's grid videos under <workspace>/compare/, newest first: each MP4 with the layout file the
    tool writes beside it (rows, columns, cells); other videos there are not grids."""
    root = Path(workspace) / "compare"
    if not root.is_dir():
        return []
    grids = []
    for video in root.rglob("*.mp4"):
        try:
            layout = json.loads(video.with_suffix(".json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(layout, dict) and {"rows", "columns", "cells"} <= layout.keys():
            grids.append(video)
    return sorted(grids, key=lambda path: path.stat().st_mtime, reverse=True)
